"""The advice as a rich table, a PNG (step time and memory per strategy) and JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from lightning_strategies.advisor.advise import Advice

__all__ = ["JSON_KEYS", "to_json", "to_json_text", "to_table", "write_png"]

#: the keys of every strategy's entry in :func:`to_json`
JSON_KEYS = ("name", "rank", "options", "step_s", "efficiency", "memory", "memory_total", "link_bytes",
             "nic_bytes", "fits", "reason")  # fmt: skip
_GIB = 1 << 30
_SHORT = {"num_stages": "K", "microbatches": "M", "tp_size": "T", "num_servers": "servers"}


def to_json(advice: Advice) -> dict[str, Any]:
    """Everything in the table, as plain data (``inf`` step times as ``null``)."""
    m, c = advice.measurement, advice.cluster
    rows = []
    for r in advice.rows:
        row = {k: getattr(r, k) for k in JSON_KEYS if hasattr(r, k)}
        row["step_s"] = r.step_s if math.isfinite(r.step_s) else None
        row["memory"] = dataclasses.asdict(r.memory)
        row["memory_total"] = r.memory.total
        rows.append(row)
    return {
        "cluster": dataclasses.asdict(c),
        "world": c.world,
        "batch_per_device": advice.batch,
        "measured": {
            "params": m.param_bytes,
            "grads": m.grad_bytes,
            "optimizer_state": m.optimizer_bytes,
            "optimizer": m.optimizer,
            "activations_saved": m.saved_bytes,
            "batch": m.batch_size,
            "step_s": m.step_s,
            "flops": m.flops,
            "blocks": len(m.blocks),
            "timed_on": m.timed_on,
        },
        "strategies": rows,
    }


def to_json_text(advice: Advice) -> str:
    return json.dumps(to_json(advice), indent=2)


def to_table(advice: Advice, title: str = "") -> Any:
    """A ``rich.table.Table`` of the strategies, fastest fitting first."""
    from rich.table import Table

    c = advice.cluster
    table = Table(title=title or f"{c.name}: {c.nodes} x {c.per_node}, batch {advice.batch} per device")
    for col in ("rank", "strategy", "step (s)", "efficiency", "GiB / device", "MB busiest link", "fits", "why"):
        table.add_column(col, justify="left" if col in ("strategy", "why") else "right")
    for r in advice.rows:
        opts = ",".join(f"{_SHORT.get(k, k)}={v}" for k, v in r.options.items())
        table.add_row(
            str(r.rank) if r.rank else "-",
            r.name + (f" ({opts})" if opts else ""),
            f"{r.step_s:.4g}" if math.isfinite(r.step_s) else "n/a",
            f"{r.efficiency:.2f}",
            f"{r.memory.total / _GIB:.3g}",
            f"{r.link_bytes / 1e6:.3g}",
            "yes" if r.fits else "NO",
            r.reason,
        )
    return table


def write_png(advice: Advice, path: Path) -> Path:
    """Two panels: step time and memory per device (stacked by kind) per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in advice.rows if math.isfinite(r.step_s)]
    names = [r.name for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.barh(names, [r.step_s for r in rows], color=["tab:blue" if r.fits else "tab:gray" for r in rows])
    ax1.set(xlabel="predicted step (s)", title=f"{advice.cluster.name}: step time (gray: does not fit)")
    ax1.invert_yaxis()
    left = [0.0] * len(rows)
    for kind in ("params", "grads", "optimizer", "activations", "buffers"):
        vals = [getattr(r.memory, kind) / _GIB for r in rows]
        ax2.barh(names, vals, left=left, label=kind)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax2.axvline(advice.cluster.device_memory_gib, color="tab:red", ls="--", label="device memory")
    ax2.set(xlabel="GiB per device (busiest)", title="peak memory per device")
    ax2.invert_yaxis()
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
