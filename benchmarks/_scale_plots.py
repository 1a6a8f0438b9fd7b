"""The figures of ``benchmarks/scale.py``: the projected step time and scaling efficiency against P,
the bytes sent per step against P, and predicted against measured steps. :func:`plot_from` draws
them again from a stored output (the printed lines only, no measurement).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from benchmarks._common import printed_values, pyplot, save_figure
from benchmarks._scale_compare import GOAL
from benchmarks._scale_costs import Cluster
from lightning_strategies.advisor.model import Prediction

LABELS = {
    "ddp": "ddp (NCCL ring)", "ring": "ring (comm.ring, flat)", "ring_hier": "ring, hierarchical",
    "ps": "ps, P shards (hierarchical push)", "ps_flat": "ps, P shards, flat push", "ps_1": "ps, 1 server",
    "ps_ring": "ps_ring (shards on the ring's halves)", "async": "async (P shards)",
    "pipeline": "pipeline (K stages x P/K)",
}  # fmt: skip
STYLE = {"ddp": "C2", "ring": "C0", "ring_hier": "C9", "ps": "C1", "ps_flat": "C6", "ps_1": "C3", "async": "C4",
         "pipeline": "C5", "ps_ring": "C8"}  # fmt: skip
#: dashed where a strategy is projected as another one's exchange (ps_ring: the hierarchical ring's; it would hide it)
DASHED = {"ps_ring"}


def _worlds(proj: dict[str, dict[int, Any]]) -> list[int]:
    """The projection's world sizes P, ascending (every strategy has the same)."""
    return sorted(next(iter(proj.values())))


def plot_projection(cluster: Cluster, proj: dict[str, dict[int, Any]], path: Path) -> None:
    """Projected step time and scaling efficiency against P, one line per strategy."""
    plt = pyplot()
    fig, (ax, ax_e) = plt.subplots(1, 2, figsize=(11, 3.9))
    worlds = _worlds(proj)
    for s, by_p in proj.items():
        fmt = "o--" if s in DASHED else "o-"
        ax.plot(worlds, [by_p[p].step_s for p in worlds], fmt, ms=3, color=STYLE[s], label=LABELS[s])
        ax_e.plot(worlds, [cluster.step_ms / 1e3 / by_p[p].step_s for p in worlds], fmt, ms=3, color=STYLE[s])
    ax.axhline(cluster.step_ms / 1e3, color="k", lw=0.8, ls=":", label="compute alone")
    for a in (ax, ax_e):
        a.set_xscale("log", base=2)
        a.set_xticks(worlds)
        a.set_xticklabels([str(p) for p in worlds])
        a.set_xlabel("GPUs P")
    ax.set_yscale("log")
    ax.set_ylabel("projected seconds per step")
    ax_e.set_ylabel("compute / step (scaling efficiency)")
    ax_e.set_ylim(0, 1.05)
    nic = f"{cluster.nic_gbit_s:g} Gb/s per node"
    ax.set_title(
        f"ResNet-50, {cluster.gpus_per_node} GPUs/node, NVLink {cluster.nvlink_gbyte_s:g} GB/s, {nic}", fontsize=9
    )
    ax_e.set_title(f"compute {cluster.step_ms:.1f} ms per step (A100, batch {cluster.batch_per_gpu})", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_traffic(cluster: Cluster, proj: dict[str, dict[int, Any]], path: Path) -> None:
    """The seed's claim 1 at scale: one server's traffic grows with P; sharded ps and the rings' do not
    (and the hierarchical push's NIC carries the hierarchical ring's bytes)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.2, 4.0))
    worlds = _worlds(proj)
    gb = 1e9
    series = [
        ("ps_1", "busiest_sent_bytes", "ps, 1 server: the server's link", "D-"),
        ("ps_flat", "nic_bytes", "ps, P shards, flat push: a node's NIC", "s-"),
        ("ps_flat", "busiest_sent_bytes", "ps, P shards, flat push: a worker", "s--"),
        ("ps", "nic_bytes", "ps, hierarchical push: a node's NIC", "x:"),
        ("ring", "nic_bytes", "flat ring: a node's NIC (= a worker's link)", "^-"),
        ("ring_hier", "nic_bytes", "hierarchical ring: a node's NIC", "v-"),
        ("ring_hier", "inter_per_worker", "hierarchical ring: a worker across nodes", "v--"),
    ]
    for s, key, label, fmt in series:
        if key == "inter_per_worker":
            ys = [proj[s][p].nic_bytes / cluster.gpus_per_node / gb for p in worlds]
        else:
            ys = [getattr(proj[s][p], key) / gb for p in worlds]
        ys = [y if y > 0 else math.nan for y in ys]  # one node: nothing crosses a NIC (log axis)
        ax.plot(worlds, ys, fmt, ms=4, color=STYLE[s], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(worlds)
    ax.set_xticklabels([str(p) for p in worlds])
    ax.set_xlabel(f"GPUs P ({cluster.gpus_per_node} per node)")
    ax.set_ylabel("GB sent per step")
    ax.set_title(f"ResNet-50's {4 * cluster.params / 1e6:.0f} MB gradient: bytes sent per step", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_validation(results: Sequence[tuple[str, str, dict]], path: Path) -> None:
    """Predicted against measured step time of every validation run, with the goal's +-15% band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    xs = [r["measured"] for _, _, r in results]
    lo, hi = 0.8 * min(xs), 1.25 * max(xs)
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * (1 - GOAL), hi * (1 - GOAL)], [lo * (1 + GOAL), hi * (1 + GOAL)], alpha=0.15)
    markers = {"P2": "o", "P3": "s", "P4": "^", "2x2": "D"}
    for s, tag, r in results:
        ax.plot(r["measured"], r["measured"] * r["ratio"], markers.get(tag, "x"), color=STYLE[s], fillstyle="none")
    for s in dict.fromkeys(s for s, _, _ in results):
        ax.plot([], [], "o", color=STYLE[s], label=s)
    for tag, m in markers.items():
        ax.plot([], [], m, color="gray", fillstyle="none", label=tag)
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured seconds per step (median)")
    ax.set_ylabel("predicted (median ratio x measured)")
    ax.set_title("scale model on this machine (band: +-15%)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def plot_from(path: Path) -> None:
    """Draw the three figures again from a stored output (``--plot-from results/scale.txt``): no
    measurement, the printed lines only."""
    values = printed_values(path)
    missing = [f"cluster_{f.name}" for f in fields(Cluster) if f"cluster_{f.name}" not in values]
    if missing or not any(name.startswith("projected_step_s_") for name in values):
        raise SystemExit(
            f"Error: {path} has no projection (found {len(values)} lines; missing "
            f"{missing[:3] or 'projected_step_s_*'}): expected the output of benchmarks/scale.py. "
            "Fix: --plot-from benchmarks/results/scale.txt"
        )
    defaults = Cluster()
    cluster = Cluster(**{f.name: type(getattr(defaults, f.name))(values[f"cluster_{f.name}"]) for f in fields(Cluster)})
    proj: dict[str, dict[int, Any]] = {}
    for name in values:  # ``projected_step_s_<s>_P<p>``, in the order the projection printed them
        if name.startswith("projected_step_s_"):
            s, _, p_text = name.removeprefix("projected_step_s_").rpartition("_P")
            p = int(p_text)
            proj.setdefault(s, {})[p] = Prediction(
                values[f"projected_step_s_{s}_P{p}"], {}, values[f"projected_worker_bytes_{s}_P{p}"],
                values[f"projected_link_bytes_{s}_P{p}"], values[f"projected_nic_bytes_{s}_P{p}"], 0.0,
            )  # fmt: skip
    results = []
    for name, measured in values.items():
        if name.startswith("scale_measured_step_s_"):
            tag = name.removeprefix("scale_measured_step_s_")
            s, _, world = tag.rpartition("_")
            ratio = values[f"scale_predicted_over_measured_{tag}"]
            results.append((s, world, {"measured": measured, "ratio": ratio}))
    plot_projection(cluster, proj, path.parent / "scale.png")
    plot_traffic(cluster, proj, path.parent / "scale_traffic.png")
    plot_validation(results, path.parent / "scale_validation.png")
