"""A validation session's costs: a preset's figures under the CPU, the link and the messages its probes found.

``advisor_validation.py`` predicts each session (one layout and rate of ``advisor_cluster.py``'s stored fits) on
its preset (``conf/cluster/emulated_<layout>_<rate>.yaml``). The presets hold a quiet machine's figures; each fit
stored what it had (``advisor_cluster.py``): a compute probe, the advisor's measurement of the MLP taken with it,
its cluster's link probe and, since 2026-12-04, its cluster's message probe (``emulated/_latency.py``). A
session stands for the median of its fits' probes (:func:`session_cpu`: one probe alone is mostly noise) and is
predicted under it (:func:`run_costs`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import median
from benchmarks._mlp_measurement import from_json
from benchmarks._scale_costs import effective_cores, slower
from lightning_strategies.advisor import Cluster
from lightning_strategies.advisor.costs import Costs, Link
from lightning_strategies.advisor.measure import Measurement

__all__ = [
    "QUIET_PROBE_S",
    "at_speed",
    "busy_between_nodes",
    "median_by_ratio",
    "quiet_rpc_round_trip_s",
    "rpc_host_s",
    "run_costs",
    "session_cpu",
    "session_measurement",
]

RESULTS = Path(__file__).parent / "results"
# The quiet machine the presets' host figures were calibrated on (scale.txt), in the probe's terms: the least loaded
# session's median probe of all stored so far (2x2 at 1gbit, 2026-12-03: advisor_probe_floor_ms 2.679 in
# advisor_validation.py's output of that day, results/advisor_validation.txt in git history at 0b92218). The
# calibration took no probe of its own; without this floor, sessions that all ran on a slow CPU set the floor
# themselves and their host work was not slowed at all.
QUIET_PROBE_S = 2.679e-3
RPC_PROBE_BYTES = 4096  # emulated/_latency.py's round trip, the calibration's rpc_small_s


def quiet_rpc_round_trip_s(world: int) -> float:
    """The calibration's bare 4 KiB RPC round trip (``rpc_small_s``, the median over its repetitions of the
    ``rpc/P<world>`` runs in ``results/scale_raw.json``): what the presets' ``rpc_overhead_us`` was measured next
    to, on the quiet machine."""
    rows = json.loads((RESULTS / "scale_raw.json").read_text())["rows"].get(f"rpc/P{world}", [])
    values = [r["calib/rpc_small_s"] for r in rows if "calib/rpc_small_s" in r]
    if not values:
        raise ValueError(f"results/scale_raw.json holds no calib/rpc_small_s for rpc/P{world}: expected the "
                         "calibration's runs. Fix: run benchmarks/scale.py")  # fmt: skip
    return median(values)


def session_cpu(session: Sequence[dict]) -> dict:
    """What a session had, from its fits' probes (``advisor_cluster.py``): ``probe`` (the medians of alone and
    together), ``cpus`` (its machine's cores), ``link`` (where every fit has one: each fresh cluster's link
    probe, their median) and ``messages`` (where any fit has them: every distinct message probe of its
    clusters, per kind their median)."""
    cpu: dict = {"probe": (median([r["probe"][0] for r in session]), median([r["probe"][1] for r in session])),
                 "cpus": min(r["cpus"] for r in session)}  # fmt: skip
    if all("link" in r for r in session):
        cpu["link"] = {k: median([r["link"][k] for r in session]) for k in ("oneway", "duplex_min")}
    # a cluster's probes (before its first fit, after its last) are stored with each of its fits: once each
    probes = {json.dumps(p, sort_keys=True): p for r in session for p in r.get("messages", []) if p}
    if probes:
        kinds = sorted({k for p in probes.values() for k in p})
        cpu["messages"] = {k: median([p[k] for p in probes.values() if k in p]) for k in kinds}
    return cpu


def busy_between_nodes(cpu: dict) -> dict:
    """``cpu`` (``session_cpu``'s) with gloo's latency between nodes the message probe's ``gloo_inter_busy`` (the
    exchange timed while the other ranks computed) where it has one; the validation prints what it would give."""
    messages = cpu.get("messages") or {}
    if "gloo_inter_busy" not in messages:
        return cpu
    return {**cpu, "messages": {**messages, "gloo_inter": messages["gloo_inter_busy"]}}


def run_costs(cluster: Cluster, m: Measurement, run: dict, probe_here_s: float, floor_s: float,
              rpc_quiet_s: float | None = None) -> Costs:  # fmt: skip
    """The preset's costs under the CPU a run had, from its probe (``advisor_cluster.py``): the MLP's step
    alone (``a``) and on P processes at once (``t``) right before the fit, against the same probe next to the
    measurement (``h``) and the quiet machine's (``q``).

    compute alone        m.step_s x a / h         (the advisor's measurement moved to the run's moment)
    cores                P x a / t                (what the run's P processes shared, other jobs taken;
                                                  at most the machine's cores, ``run["cpus"]``)
    host work, wake-ups  x a / q                  (the presets' figures are a quiet machine's: scale.txt)
    wire between nodes   unchanged                (a shaped link's rate is the network's, not CPU work),
                         or where the run has a link probe (``advisor_cluster.link_probe``): the slower
                         direction of a stream each way at once (most strategies send and receive at
                         once), ``duplex_share`` that over one stream alone (ps1's one direction at a time)
    a message's latency  the presets' (a quiet machine's median), or where the run has a message probe
                         (``run["messages"]``, ``emulated/_latency.py``): gloo's per message inside a node
                         (``gloo_intra``) and between nodes (``gloo_inter``: the wire's latency with it); with
                         ``rpc_quiet_s`` also an RPC message's host work (``rpc_overhead_s``) x the probe's 4 KiB
                         round trip over the calibration's (between nodes, the wire's round trip taken out). The
                         validation predicts without it and prints what it gives: the ps protocol's work per
                         message is not a bare RPC's, and at 4x1 1gbit the bare round trip's 3.0 x over-predicted
                         flat ps and async by 0.38-0.41, against 0.01-0.02 without it (``docs/advisor.md``)
    """
    alone, together = run["probe"]
    quiet = cluster.costs(m.step_s * floor_s / probe_here_s)
    costs = slower(quiet, alone / floor_s)
    inter = quiet.inter
    if cluster.nodes > 1 and run.get("link"):  # the session's link probe: both directions at once, the slower one
        duplex, oneway = run["link"]["duplex_min"], run["link"]["oneway"]
        inter = Link(quiet.inter.latency_s, duplex)
        costs = costs.with_(duplex_share=min(1.0, duplex / oneway))
    messages = run.get("messages") or {}
    if messages:
        inter = Link(messages["gloo_inter"], inter.bandwidth)
        if "gloo_intra" in messages:
            costs = costs.with_(intra=Link(messages["gloo_intra"], costs.intra.bandwidth),
                                rpc_intra=Link(messages["gloo_intra"], costs.rpc_intra.bandwidth))  # fmt: skip
        if rpc_quiet_s is not None:
            slowed = rpc_host_s(cluster, messages, inter) / rpc_quiet_s
            costs = costs.with_(rpc_overhead_s=quiet.rpc_overhead_s * slowed)
    if cluster.nodes > 1:
        costs = costs.with_(inter=inter, rpc_inter=inter)
    return costs.with_(cores=effective_cores(cluster.world, alone, together, run.get("cpus")))


def rpc_host_s(cluster: Cluster, messages: dict, inter: Link) -> float:
    """The host's part of the message probe's 4 KiB RPC round trip: inside a node where it has one
    (``rpc_intra``), else between nodes less the wire's round trip (2 x the preset's ``latency_us`` and the
    payload both ways at ``inter``'s rate); never below a tenth of the round trip."""
    if "rpc_intra" in messages:
        return float(messages["rpc_intra"])
    whole = float(messages["rpc_inter"])
    wire = 2 * cluster.latency_us * 1e-6 + 2 * RPC_PROBE_BYTES / inter.bandwidth
    return max(whole / 10, whole - wire)


def at_speed(m: Measurement, factor: float) -> Measurement:
    """``m`` on a CPU ``factor`` times slower: every block's times (what the pipeline's stages take from the
    measurement itself, where the other strategies take ``Costs.compute_s``) and the optimizer step scaled
    alike."""
    blocks = tuple(dataclasses.replace(b, forward_s=b.forward_s * factor, backward_s=b.backward_s * factor,
                                       forward_fixed_s=b.forward_fixed_s * factor,
                                       backward_fixed_s=b.backward_fixed_s * factor) for b in m.blocks)  # fmt: skip
    return dataclasses.replace(m, blocks=blocks, optimizer_s=m.optimizer_s * factor)


def median_by_ratio(measured: Sequence[tuple[Measurement, float]]) -> tuple[Measurement, float]:
    """Of (measurement, its probe) pairs, the one whose ratio of the two is the median (the upper of two middles)."""
    return sorted(measured, key=lambda g: g[0].step_s / g[1])[len(measured) // 2]


def session_measurement(session: Sequence[dict], m: Measurement, here: float) -> tuple[Measurement, float, str]:
    """What a session's fits are predicted from, with the probe taken next to it: where every fit stored the
    advisor's measurement taken with its probe (``advisor_cluster.py``), the one whose ratio to that probe is
    the median (the session's own moment: no measurement here moved to it); else ``m`` and ``here``, the
    measurement here (``advisor_validation.measure_here``)."""
    own = [(from_json(r["measurement"]), r["probe"][0]) for r in session if "measurement" in r]
    if not own or len(own) < len(session):
        return m, here, "here"
    return *median_by_ratio(own), "its fits'"
