"""The scale model against measurement (``benchmarks/scale.py``): a world's calibration from its
repetitions, each measured step beside its prediction, the bytes each worker sends, and the
calibrated constants as printed lines.

A repetition's row (``_scale_measure.world_worker``) holds the calibration figures (``calib/<name>``)
and each strategy's timed steps (``<s>/step_s``) with the probe taken just before each step
(``<s>/probe_alone_s``, ``<s>/probe_all_s``); :func:`compare` scales the world's constants to the
machine of that moment before predicting the step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks._common import line, median
from benchmarks._scale_costs import LATENCY_KEYS, effective_cores, machine_costs, slower
from lightning_strategies.advisor.model import Costs, Link, Workload, predict

#: the validation's goal: |median(predicted / measured) - 1| of every (strategy, P) cell
GOAL = 0.15
#: a link that costs nothing (bytes do not depend on it)
FAST = Link(0.0, math.inf)


def calib_of(row: dict[str, Any]) -> dict[str, float]:
    return {k.removeprefix("calib/"): v for k, v in row.items() if k.startswith("calib/")}


def machine_workload(calib: dict[str, float], world: int, sizes: Sequence[int], pipe: dict) -> Workload:
    fwd, bwd = calib.get("stage_forward_s"), calib.get("stage_backward_s")
    return Workload(
        grad_bytes=4.0 * sum(sizes),
        tensors=len(sizes),
        stages=world,
        microbatches=pipe["microbatches"],
        activation_bytes=4.0 * pipe["rows"] * pipe["dim"],
        stage_compute_s=None if fwd is None or bwd is None else fwd + bwd,
        backward_share=2 / 3 if fwd is None or bwd is None else bwd / (fwd + bwd),
    )


def pooled_calibration(rows: Sequence[dict], *, latency_median: bool = True) -> dict[str, float]:
    """One world's calibration over its repetitions (every round): the constants the model uses.

    Work figures: their minimum, the least disturbed value (other jobs only ever add time; the probe
    before each step says how much slower the machine is then, :func:`compare`). Latency figures
    (``LATENCY_KEYS``, each a mean over its trials within a repetition): their median over the
    repetitions, the run's typical value (``latency_median=False``: their minimum too, a host that
    no other job shares, for the projection). None of them is a strategy's step.
    """
    calibs = [calib_of(row) for row in rows]
    # the hops of a repetition at the machine's quietest speed (its own compute alone against the
    # least disturbed one), as the probe scales them back per step (``slower``)
    quietest = min((c["compute_s"] for c in calibs if "compute_s" in c), default=1.0)
    calibs = [
        {k: v * quietest / c["compute_s"] if k.startswith("wake_") and "compute_s" in c else v for k, v in c.items()}
        for c in calibs
    ]
    out = {}
    for k in dict.fromkeys(k for c in calibs for k in c):
        values = [c[k] for c in calibs if k in c]
        out[k] = float(statistics.median(values) if latency_median and k in LATENCY_KEYS else min(values))
    return out


#: figures of a world without RPC that depend on its P (the rest are a pair's, or one rank's, while
#: the other ranks idle in a barrier, which costs nothing without an RPC agent polling)
P_DEPENDENT_COLL = frozenset({"compute_all_s"})


def world_calibration(rows: dict[str, list[dict]], kind: str, world: int) -> dict[str, float]:
    """The constants for the ``kind`` world of ``world`` processes.

    With RPC every figure depends on P (each process's agent polls, idle or not: P pollers share
    the cores with whatever is measured), so they come from that world's repetitions alone.
    Without RPC a figure measured by one rank or a pair does not depend on the idle others, so it
    is pooled over every such world (3x the repetitions against load bursts), and only
    :data:`P_DEPENDENT_COLL` (and the wake-ups, keyed by their busy count) are the world's own.
    """
    own = pooled_calibration(rows[f"{kind}/P{world}"])
    if kind == "rpc":
        return own
    shared = pooled_calibration([row for key, rows_ in rows.items() if key.startswith(f"{kind}/") for row in rows_])
    return {**shared, **{k: v for k, v in own.items() if k in P_DEPENDENT_COLL}}


def compare(
    rows: list[dict],
    calib: dict[str, float],
    world: int,
    strategies: Sequence[str],
    sizes: Sequence[int],
    pipe: dict,
    local_size: int | None = None,
) -> tuple[dict[str, dict], list[Costs]]:
    """Per strategy: measured and predicted medians, the median ratio, its halves, and each run's costs.

    A step's prediction: the world's constants (``calib``, from its calibration runs) scaled to the
    machine of that moment by the probe taken just before the step: the stand-in alone against its
    quiet value (the speed of CPU work, which on loopback messages are too) and on all P at once
    against alone (the contention). ``A`` and ``B``: the even and the odd rounds (or torchrun
    invocations), separate process worlds at different times: two measurements of the same cell.
    """
    out = {}
    costs_all: list[Costs] = []
    calib = {**calib, "microbatches": float(pipe["microbatches"])}
    work = machine_workload(calib, world, sizes, pipe)
    base = machine_costs(calib, world, local_size=local_size, tensors=work.tensors, grad_bytes=work.grad_bytes)
    for s in strategies:
        steps: list[tuple[float, float, int]] = []  # (measured, predicted, round)
        phases: dict[str, list[float]] = {}
        loads: list[float] = []
        for row in rows:
            key = f"{s}/step_s"
            if key not in row:
                continue
            loads.append(row[f"{s}/load"])
            for i, seconds in enumerate(row[key]):  # every step beside the probe taken just before it
                probe = {k: row[f"{s}/probe_{k}"][i] for k in ("alone_s", "all_s")}
                costs = slower(base, probe["alone_s"] / base.compute_s).with_(
                    cores=effective_cores(world, probe["alone_s"], probe["all_s"])
                )
                costs_all.append(costs)
                pred = predict(s, costs, world, work)
                steps.append((seconds, pred.step_s, int(row["round"])))
                for k, v in pred.phases.items():
                    phases.setdefault(k, []).append(v)
        if not steps:
            print(f"# {s} P={world}: no step measured (missing from every repetition)", flush=True)
            continue
        halves = {h: [x for x in steps if x[2] % 2 == h] for h in (0, 1)}
        out[s] = {
            "measured": median([m for m, _, _ in steps]),
            "predicted": median([p for _, p, _ in steps]),
            "ratio": median([p / m for m, p, _ in steps]),
            "ratios": [p / m for m, p, _ in steps],
            "halves": [(median([m for m, _, _ in h]), median([p / m for m, p, _ in h])) for h in halves.values() if h],
            "phases": {k: median(v) for k, v in phases.items()},
            "load": median(loads),
            "rounds": len({r for _, _, r in steps}),
        }
    return out, costs_all


def bytes_errors(
    rows: list[dict], world: int, sizes: Sequence[int], tag: str, local_size: int | None = None
) -> dict[str, float]:
    """|model / measured - 1| of the bytes the busiest worker sends per step, as the strategies count them."""
    out = {}
    work = Workload(grad_bytes=4.0 * sum(sizes), tensors=len(sizes))
    costs = Costs(compute_s=0.0, local_size=local_size or world, intra=FAST, inter=FAST)
    for s in ("ring", "ring_hier", "ps", "ps_1", "async"):
        # bytes do not depend on the load: one repetition says it
        for row in [r for r in rows if f"{s}/sent_bytes" in r][:1]:
            pred = predict(s, costs, world, work)
            for key, want in (("sent", pred.busiest_sent_bytes), ("inter_sent", pred.inter_sent_bytes)):
                if f"{s}/{key}_bytes" not in row:
                    continue
                name = f"{s}_{tag}" if key == "sent" else f"{s}_inter_node_{tag}"
                out[name] = abs(want / row[f"{s}/{key}_bytes"] - 1)
                line(f"scale_bytes_sent_{name}", row[f"{s}/{key}_bytes"], "bytes")
                line(f"scale_bytes_error_{name}", out[name], "fraction")
    return out


def print_calibration(costs: Costs, tag: str = "", kinds: Sequence[str] = ("coll", "rpc")) -> None:
    """The constants of ``costs``: the ones its world kinds measure (``coll``, ``rpc``)."""
    line(f"calib_compute_s{tag}", costs.compute_s, "s")
    line(f"calib_effective_cores_quiet{tag}", costs.cores or 0.0, "cores")
    for b, seconds in enumerate(costs.hop_s):
        line(f"calib_wake_us_busy{b}{tag}", 1e6 * seconds, "us")
    line(f"calib_reduce_ns_per_byte{tag}", 1e9 * costs.reduce_s_per_byte, "ns/B")
    if "coll" in kinds:
        line(f"calib_gloo_latency_us{tag}", 1e6 * costs.intra.latency_s, "us")
        line(f"calib_gloo_bandwidth{tag}", costs.intra.bandwidth / 1e9, "GB/s")
        line(f"calib_ring_overhead_us{tag}", 1e6 * costs.ring_overhead_s, "us")
        line(f"calib_pipeline_chunk_overhead_us{tag}", 1e6 * costs.chunk_overhead_s, "us")
    if "rpc" in kinds:
        line(f"calib_rpc_overhead_us{tag}", 1e6 * costs.rpc_overhead_s, "us")
        line(f"calib_rpc_bandwidth{tag}", costs.rpc_intra.bandwidth / 1e9, "GB/s")
        if costs.rpc_exchange_s is not None:
            line(f"calib_rpc_exchange_ms{tag}", 1e3 * costs.rpc_exchange_s, "ms")
        if costs.rpc_gather_s is not None:
            line(f"calib_rpc_gather_ms{tag}", 1e3 * costs.rpc_gather_s, "ms")
        line(f"calib_ps_protocol_us_per_peer{tag}", 1e6 * costs.ps_protocol_s, "us")
        for part in ("client", "average", "update"):
            line(f"calib_ps_{part}_ns_per_byte{tag}", 1e9 * getattr(costs, f"ps_{part}_s_per_byte"), "ns/B")
            line(f"calib_ps_{part}_us_per_tensor{tag}", 1e6 * getattr(costs, f"ps_{part}_s_per_tensor"), "us")
