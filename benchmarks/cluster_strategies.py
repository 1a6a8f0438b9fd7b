"""Every strategy on an emulated cluster (nodes as namespaces, HTB-shaped links): step time and NIC bytes.

Each configuration is a Lightning fit (``benchmarks/emulated/_fit.py``: an MLP of 1.31 M parameters,
D = 5.25 MB of fp32 gradients, batch 32 per replica, synthetic data) under torchrun on an
:class:`~benchmarks.emulated.EmulatedCluster`, launched by :func:`benchmarks.emulated.launch.launch`
exactly as a multi-node job. Layouts: 2 nodes x 2 processes ("2x2") and 4 nodes x 1 ("4x1"); link
rates 1gbit, 200mbit, 50mbit (both directions of every node's link). Strategies:

    ddp        Lightning's DDPStrategy on gloo
    ring       RingAllReduceStrategy(hierarchical=False): the flat ring
    ring_hier  RingAllReduceStrategy(hierarchical=True): reduce-scatter in the node, ring across nodes
    ring_bf16  the flat ring with bf16 on the wire
    ps         ParameterServerStrategy: one shard per process; hierarchical push on 2x2 (one per node on 4x1: flat)
    ps_flat    ParameterServerStrategy(hierarchical=False): every process pushes to every shard (2x2 only)
    ps_one_shot ParameterServerStrategy(overlap=False): ps's push after the whole backward, its pull in the step
    ps_aligned, ps_unaligned  ParameterServerStrategy(align_pushes=True / False): each step's pushes after every
               worker's values landed, or not (ps aligns by default where its push is flat across nodes: 4x1)
    ps_one_reply, ps_bucket_replies  ParameterServerStrategy(reply_per_bucket=False / True): a shard steps and
               answers once every bucket of every worker is in (the contiguous plan), or every bucket is split over
               every shard and each answered as soon as every worker pushed it
    ps_bucket_plan  ps_bucket_replies' plan (every bucket split over every shard) with one step and one reply per
               shard (not a mode users get: which half of reply_per_bucket does what)
    ps_local_sigterm  ps with Lightning's blocking SIGTERM broadcast before every step replaced by each rank's
               own check (what async does): what that broadcast costs ps (not a strategy users get: a SIGTERM
               to rank 0 alone would no longer stop the others)
    ps1        ParameterServerStrategy(num_servers=1): one server, on rank 0 (node 0); across nodes of one process
               each bucket is answered alone (reply_per_bucket's default)
    ps1_one_reply  ps1 with reply_per_bucket=False: the server steps and answers once every worker pushed every
               bucket (the A/B of ps1's default)
    ps_ring    RingParameterServerStrategy: ps's co-located shards (one per process) pushed by comm.ring's
               reduce-scatter and pulled by its all-gather, per bucket during backward; hierarchical on 2x2
    ps_ring_flat  RingParameterServerStrategy(hierarchical=False): one flat ring (2x2 only)
    async      AsyncParameterServerStrategy (one shard per process, no staleness bound): the node is the
               asynchronous worker on 2x2 (sums in the node, pushes 1/L per process), flat on 4x1
    async_flat AsyncParameterServerStrategy(hierarchical=False): every process pushes to every shard (2x2 only)
    pipeline   PipelineStrategy: one stage per process, 1F1B, the global batch in 4 x stages micro-batches
    tensor     TensorParallelStrategy: every linear layer split over the whole world

A round runs every (layout, rate) on a fresh cluster, the strategies in an order rotated from round
to round; the step time of a run is, per rank, the median of its steps after ``--warmup``, then the
ranks' harmonic mean (one number per run that is also the world's rate for async, where ranks do
not step together). Lines (``name value unit``; medians over rounds, the spread beside them):

    cluster_step_s_<strategy>_<layout>_<rate>              s; ``..._spread``: (max - min) / median
                                                           over rounds (over the timed steps with 1 round)
    cluster_cpu_ms_per_step_<strategy>_<layout>_<rate>     ms: a process's CPU time (every thread) over the
                                                           timed steps per step, the median over ranks and rounds
    cluster_wall_s_per_step_<strategy>_<layout>_<rate>     s: the timed steps' wall time over their count
                                                           (the time between steps too), ranks' harmonic mean
    cluster_nic_bytes_per_step_<strategy>_<layout>_<rate>  the busiest node's link, busier direction,
                                                           over the timed steps, as the veth counts it
                                                           (66 B of headers per GSO packet: +0.2-0.3%)
    ..._over_formula                                        that over the formula below (data-parallel
                                                           strategies only: the pipeline's and tensor's
                                                           bytes are activations, which depend on the cut)
    cluster_ring_hier_over_flat_2x2_<rate>     step ring_hier / ring            goal <= 0.75 at <= 200mbit
    cluster_ring_bf16_over_ring_2x2_<rate>     step ring_bf16 / ring            goal <= 0.6 at 50mbit
    cluster_ps1_over_ps_4x1_<rate>             step ps1 / ps                    goal >= 1.7 at 50mbit
    cluster_ps_over_ddp_<layout>_<rate>        step ps / ddp                    goal <= 1.05 (#28)
    cluster_ps_ring_over_ddp_<layout>_<rate>   step ps_ring / ddp               goal <= 1.05 (#28's, for ps_ring)
    cluster_ps_ring_over_ps_<layout>_<rate>    step ps_ring / ps
    cluster_ps_ring_hier_over_flat_2x2_<rate>  step ps_ring / ps_ring_flat
    cluster_ps_over_ddp_wall_<layout>_<rate>   wall per step ps / ddp
    cluster_ps_hier_over_flat_2x2_<rate>       step ps / ps_flat
    cluster_ps_local_sigterm_over_ddp_wall_<layout>_<rate>  wall per step ps_local_sigterm / ddp
    cluster_ps_sigterm_broadcast_share_<layout>_<rate>  (wall ps - wall ps_local_sigterm) / wall ps: the share
                                               of ps's wall time Lightning's per-step broadcast takes
    cluster_ps_overlap_over_one_shot_<layout>_<rate>  step ps / ps_one_shot (the overlapped push's A/B)
    cluster_<ps|ps_aligned>_over_unaligned_<layout>_<rate>  step over ps_unaligned's (the alignment's A/B);
                                               ``..._wall_...``: the same of wall time per step
    cluster_<ps|ps_bucket_replies|ps_bucket_plan>_over_one_reply_<layout>_<rate>  step over ps_one_reply's (the
                                               replies per bucket's A/B); ``..._wall_...``: of wall time per step
    cluster_ps_bucket_replies_over_ddp[_wall]_<layout>_<rate>  step (wall per step) ps_bucket_replies / ddp
    cluster_ps1_over_one_reply[_wall]_<layout>_<rate>  step (wall per step) ps1 / ps1_one_reply
    cluster_async_over_ddp_<layout>_<rate>     step async / ddp (#28: the node as the worker)
    cluster_async_over_ddp_wall_<layout>_<rate>   wall per step async / ddp
    cluster_async_hier_over_flat_2x2_<rate>    step async / async_flat
    cluster_async_over_sync_straggler_<rate>   rate async / rate ps at 2x2 with node 1 slowed (k = 2)

Formulas, bytes through the busiest node's link per step, P processes, L per node, in D:
flat ring and ddp (gloo's ring) 2(P-1)/P (bf16: half); hierarchical 2(N-1)/N with N = P/L nodes;
ps 2(N-1)/N (hierarchical push: each node pushes B - B_n and answers N - 1 pushers per shard it hosts,
``lightning_strategies.comm.ps.node_nic_bytes``; with L = 1 that is the flat push's 2L(P-L)/P too);
async 2(N-1)/N as ps (the node pushes once per shard; ``node_nic_bytes``); ps_flat and async_flat 2L(P-L)/P
(each process pushes and serves the shards on other nodes); ps1 (P-L) (the
server's node sends every remote worker the parameters and receives its gradients).

The straggler runs (``benchmarks/stragglers.py``'s method): every rank sleeps ``--base-ms`` before its
optimizer step, standing in for heavier compute, and the last node's ranks sleep once more their own
compute, i.e. are 2x slower; ps waits for them every step, async does not.

    python benchmarks/cluster_strategies.py            # all of it, 2 rounds (~1 h on 2 loaded cores)
    python benchmarks/cluster_strategies.py --rounds 1 # what results/cluster_strategies.txt holds
    python benchmarks/cluster_strategies.py --quick    # 2x2 at 200mbit, ps, 1 round (< 1 min; CI)
    python benchmarks/cluster_strategies.py --from-raw benchmarks/results/cluster_strategies.json  # replot
    python benchmarks/cluster_strategies.py --strategies ddp ps --no-straggler --name cluster_ps  # ps vs ddp
    python benchmarks/cluster_strategies.py --strategies ps ring_hier ddp --layouts 2x2 --no-straggler \
        --link-sample-ms 4 --steps 8 --name cluster_link_timeline  # when each link carries bytes in a step

``--backward-ms t`` makes every fit's backward t ms longer (each linear layer sleeps its share; ``_fit.py``): a
heavier model, whose backward an overlapped push can hide communication behind.

``--link-sample-ms`` adds, per configuration, when each node's link carries bytes within a step and,
under ps, the overlapped push's events (``link_*`` lines, ``results/<name>_link.png``;
``benchmarks/_link_timeline.py`` says what each line is).

The full run writes ``results/cluster_strategies.txt`` (this output), ``results/cluster_strategies.json``
(every run's per-rank step durations and NIC counters) and ``results/cluster_strategies.png``.
Skips with the reason (exit 0, one comment line) where the cluster cannot be made.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _link_timeline
from benchmarks._common import line as emit
from benchmarks._common import load_average, load_line, median, pyplot, save_figure, spread
from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.cluster import parse_rate
from benchmarks.emulated.launch import launch, report_start

FIT = Path(__file__).parent / "emulated" / "_fit.py"
RESULTS = Path(__file__).parent / "results"
STRATEGIES = (
    "ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps_flat", "ps_one_shot", "ps_local_sigterm", "ps1", "async",
    "async_flat", "pipeline", "tensor", "ps_aligned", "ps_unaligned", "ps_one_reply",
    "ps_bucket_replies", "ps_bucket_plan", "ps1_one_reply", "ps_ring",
    "ps_ring_flat",
)  # fmt: skip
# variants of ps for an A/B of one option: run when named (--strategies)
AB_ONLY = (
    "ps_ring_flat",
    "ps_one_shot",
    "ps_local_sigterm",
    "ps_aligned",
    "ps_unaligned",
    "ps_one_reply",
    "ps_bucket_replies",
    "ps_bucket_plan",
    "ps1_one_reply",
)
LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1)}
RATES = ("50mbit", "200mbit", "1gbit")  # slowest first: the goals are there
STRAGGLER = ("ps", "async")
SLOW_FACTOR = 2.0


def formula_over_d(strategy: str, nodes: int, per_node: int) -> float | None:
    """Bytes through the busiest node's link per step, in D (None where activations, not gradients, flow)."""
    p, n, local = nodes * per_node, nodes, per_node
    ring = 2 * (p - 1) / p
    table = {
        "ddp": ring,
        "ring": ring,
        "ring_bf16": ring / 2,
        "ring_hier": 2 * (n - 1) / n,
        "ps": 2 * (n - 1) / n,
        "ps_one_shot": 2 * (n - 1) / n,
        "ps_local_sigterm": 2 * (n - 1) / n,
        "ps_aligned": 2 * (n - 1) / n,
        "ps_unaligned": 2 * (n - 1) / n,
        "ps_one_reply": 2 * (n - 1) / n,
        "ps_bucket_replies": 2 * (n - 1) / n,
        "ps_bucket_plan": 2 * (n - 1) / n,
        "ps_flat": 2 * local * (p - local) / p,
        "async": 2 * (n - 1) / n,  # the node as the worker (L = 1: the flat push's 2L(P-L)/P too)
        "async_flat": 2 * local * (p - local) / p,
        "ps_ring": 2 * (n - 1) / n,  # the hierarchical ring's halves (4x1: the flat ring's)
        "ps_ring_flat": ring,
        "ps1": float(max(p - local, local)),
        "ps1_one_reply": float(max(p - local, local)),
    }
    return table.get(strategy)


def run_one(
    cluster: EmulatedCluster,
    strategy: str,
    per_node: int,
    *,
    steps: int,
    warmup: int,
    extra: Sequence[str] = (),
    timeout: float = 600.0,
) -> dict[str, Any]:
    """One fit on ``cluster``: per-rank records, the run's step time and its busiest NIC's bytes per step
    (``timeout``: seconds before the fit is stopped and counted as failed)."""
    with tempfile.TemporaryDirectory(prefix="cluster-strategies-") as tmp:
        argv = ["python", str(FIT), "--strategy", strategy, "--steps", str(steps), "--warmup", str(warmup),
                "--out", tmp, *extra]  # fmt: skip
        result = launch(cluster, argv, per_node=per_node, timeout=timeout, echo=False)
        records = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if result.returncode != 0 or len(records) != len(cluster.nodes) * per_node:
        tails = "\n".join(f"--- node {i}:\n{out[-2500:]}" for i, out in enumerate(result.outputs))
        raise RuntimeError(f"{strategy} on {len(cluster.nodes)}x{per_node} at {cluster.rate}: exit "
                           f"{result.returncode}, {len(records)} rank records\n{tails}")  # fmt: skip
    per_rank = [median(r["durations"][warmup:]) for r in records]
    step_s = len(per_rank) / sum(1 / s for s in per_rank)
    # the timed window's wall time per step: the time between steps too (Lightning's loop, and work of
    # other threads a step leaves behind, as ps's shards answering after the step's pushes)
    walls = [r["window"]["wall"] / r["window"]["steps"] for r in records if r.get("window", {}).get("steps")]
    wall_s = len(walls) / sum(1 / s for s in walls) if walls else float("nan")
    # per node (its local rank 0 read the counters): its bytes over that rank's timed steps (async
    # ranks take different numbers of steps; the others take --steps each)
    busiest = max(
        max(r["nic"]["end"][k] - r["nic"]["start"][k] for k in ("tx_bytes", "rx_bytes")) / (r["steps"] - warmup)
        for r in records
        if r["nic"]
    )
    # the timed steps of the slowest rank, for the spread of a single round
    slowest = max(records, key=lambda r: median(r["durations"][warmup:]))
    return {"step_s": step_s, "wall_s": wall_s, "nic_bytes": busiest, "steps_s": slowest["durations"][warmup:],
            "D": records[0]["params"] * 4, "records": records, "seconds": result.seconds}  # fmt: skip


def schedule(args: argparse.Namespace) -> Iterator[tuple[int, str, str, list[str]]]:
    """``(round, rate, layout, strategies)``: every configuration ``args.rounds`` times, a fresh cluster for each,
    the strategies' order rotated by round and rate so no strategy always runs first."""
    for r in range(args.rounds):
        for rate in args.rates:
            for layout in args.layouts:
                shift = (r + list(args.rates).index(rate)) % len(args.strategies)
                yield r, rate, layout, [*args.strategies[shift:], *args.strategies[:shift]]


def measure(
    args: argparse.Namespace, log: list[str], save: Callable[[dict[str, list[dict[str, Any]]]], object]
) -> dict[str, list[dict[str, Any]]]:
    """Every configuration ``args.rounds`` times, interleaved; raw runs by key ``strategy|layout|rate``.
    A comment line per run goes to ``log`` (and stdout); ``save`` gets the runs so far after every
    cluster, so a run cut short keeps what it measured."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    failed = args.failed
    for r, rate, layout, order in schedule(args):
        nodes, per_node = LAYOUTS[layout]
        # one process per node: ps_flat is ps, async_flat is async
        cases: list[tuple[str, str, list[str]]] = [
            (s, s, []) for s in order if s not in ("ps_flat", "async_flat", "ps_ring_flat") or per_node > 1
        ]
        if args.straggler and layout == "2x2":
            slow = ["--base-ms", str(args.base_ms), "--slow-node-factor", str(SLOW_FACTOR)]
            pair = STRAGGLER if r % 2 == 0 else STRAGGLER[::-1]
            cases += [(f"{s}_straggler", s, slow) for s in pair]
        sample = ["--link-sample-ms", str(args.link_sample_ms)] if args.link_sample_ms > 0 else []
        sample += ["--backward-ms", str(args.backward_ms)] if args.backward_ms > 0 else []
        with EmulatedCluster(nodes=nodes, rate=rate) as cluster:
            for name, strategy, extra in cases:
                try:
                    run = run_one(cluster, strategy, per_node, steps=args.steps, warmup=args.warmup,
                                  extra=[*extra, *sample])  # fmt: skip
                except RuntimeError as err:
                    # one strategy's failure is a result too: the others still get measured
                    log.append(f"# round {r} {name} {layout} {rate}: FAILED: " + str(err).replace("\n", "\n#   "))
                    print(log[-1], flush=True)
                    failed.append(f"{name}|{layout}|{rate}")
                    continue
                runs[f"{name}|{layout}|{rate}"].append(run)
                log.append(f"# round {r} {name} {layout} {rate}: {run['step_s']:.4f} s/step, "
                           f"{run['nic_bytes'] / run['D']:.4f} D/step on the busiest link, "
                           f"{run['seconds']:.0f} s wall, load {load_average()}")  # fmt: skip
                print(log[-1], flush=True)
        save(runs)
    return runs


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, *, echo: bool = True) -> list[str]:
    """The ``name value unit`` lines from the raw runs (printed when ``echo``)."""
    out: list[str] = []

    def line(name: str, value: float, unit: str) -> str:
        return emit(name, value, unit) if echo else f"{name} {value:.4g} {unit}"

    step: dict[str, float] = {}
    wall: dict[str, float] = {}
    for key, rs in runs.items():
        name, layout, rate = key.split("|")
        tag = f"{name}_{layout}_{rate}"
        step[key] = median([r["step_s"] for r in rs])
        values = [r["step_s"] for r in rs] if len(rs) > 1 else rs[0]["steps_s"]
        out.append(line(f"cluster_step_s_{tag}", step[key], "s"))
        out.append(line(f"cluster_step_s_{tag}_spread", spread(values), "x"))
        if all("wall_s" in r for r in rs):
            wall[key] = median([r["wall_s"] for r in rs])
            out.append(line(f"cluster_wall_s_per_step_{tag}", wall[key], "s"))
        cpu = [r["window"]["cpu"] / r["window"]["steps"] for run in rs for r in run["records"]
               if r.get("window", {}).get("steps") and "cpu" in r["window"]]  # fmt: skip
        if cpu:
            out.append(line(f"cluster_cpu_ms_per_step_{tag}", 1000 * median(cpu), "ms"))
        if name.endswith("_straggler"):
            continue
        nic = median([r["nic_bytes"] for r in rs])
        out.append(line(f"cluster_nic_bytes_per_step_{tag}", nic, "bytes"))
        nodes, per_node = LAYOUTS[layout]
        f = formula_over_d(name, nodes, per_node)
        if f is not None:
            out.append(line(f"cluster_nic_bytes_per_step_{tag}_over_formula", nic / (f * rs[0]["D"]), "x"))

    def ratio(label: str, a: str, b: str) -> None:
        if a in step and b in step:
            out.append(line(label, step[a] / step[b], "x"))

    def wall_ratio(label: str, a: str, b: str) -> None:
        if a in wall and b in wall:
            out.append(line(label, wall[a] / wall[b], "x"))

    for rate in args.rates:
        ratio(f"cluster_ring_hier_over_flat_2x2_{rate}", f"ring_hier|2x2|{rate}", f"ring|2x2|{rate}")
        ratio(f"cluster_ring_bf16_over_ring_2x2_{rate}", f"ring_bf16|2x2|{rate}", f"ring|2x2|{rate}")
        ratio(f"cluster_ps1_over_ps_4x1_{rate}", f"ps1|4x1|{rate}", f"ps|4x1|{rate}")
        ratio(f"cluster_ps_hier_over_flat_2x2_{rate}", f"ps|2x2|{rate}", f"ps_flat|2x2|{rate}")
        ratio(f"cluster_ps_ring_hier_over_flat_2x2_{rate}", f"ps_ring|2x2|{rate}", f"ps_ring_flat|2x2|{rate}")
        for layout in args.layouts:
            ratio(f"cluster_ps_over_ddp_{layout}_{rate}", f"ps|{layout}|{rate}", f"ddp|{layout}|{rate}")
            ratio(f"cluster_ps_overlap_over_one_shot_{layout}_{rate}", f"ps|{layout}|{rate}",
                  f"ps_one_shot|{layout}|{rate}")  # fmt: skip
            ratio(f"cluster_async_over_ddp_{layout}_{rate}", f"async|{layout}|{rate}", f"ddp|{layout}|{rate}")
            ratio(f"cluster_ps_ring_over_ddp_{layout}_{rate}", f"ps_ring|{layout}|{rate}", f"ddp|{layout}|{rate}")
            ratio(f"cluster_ps_ring_over_ps_{layout}_{rate}", f"ps_ring|{layout}|{rate}", f"ps|{layout}|{rate}")
            for s in ("ps", "async", "ps_local_sigterm", "ps_unaligned"):
                wall_ratio(f"cluster_{s}_over_ddp_wall_{layout}_{rate}", f"{s}|{layout}|{rate}", f"ddp|{layout}|{rate}")
            for s in ("ps", "ps_aligned"):
                a, b = f"{s}|{layout}|{rate}", f"ps_unaligned|{layout}|{rate}"
                ratio(f"cluster_{s}_over_unaligned_{layout}_{rate}", a, b)
                wall_ratio(f"cluster_{s}_over_unaligned_wall_{layout}_{rate}", a, b)
            for s in ("ps", "ps_bucket_replies", "ps_bucket_plan"):
                a, b = f"{s}|{layout}|{rate}", f"ps_one_reply|{layout}|{rate}"
                ratio(f"cluster_{s}_over_one_reply_{layout}_{rate}", a, b)
                wall_ratio(f"cluster_{s}_over_one_reply_wall_{layout}_{rate}", a, b)
            a, b = f"ps1|{layout}|{rate}", f"ps1_one_reply|{layout}|{rate}"
            ratio(f"cluster_ps1_over_one_reply_{layout}_{rate}", a, b)
            wall_ratio(f"cluster_ps1_over_one_reply_wall_{layout}_{rate}", a, b)
            wall_ratio(f"cluster_ps_bucket_replies_over_ddp_wall_{layout}_{rate}", f"ps_bucket_replies|{layout}|{rate}",
                       f"ddp|{layout}|{rate}")  # fmt: skip
            ratio(f"cluster_ps_bucket_replies_over_ddp_{layout}_{rate}", f"ps_bucket_replies|{layout}|{rate}",
                  f"ddp|{layout}|{rate}")  # fmt: skip
            a, b = f"ps|{layout}|{rate}", f"ps_local_sigterm|{layout}|{rate}"
            if a in wall and b in wall:
                out.append(
                    line(f"cluster_ps_sigterm_broadcast_share_{layout}_{rate}", (wall[a] - wall[b]) / wall[a], "x")
                )
        ratio(f"cluster_async_hier_over_flat_2x2_{rate}", f"async|2x2|{rate}", f"async_flat|2x2|{rate}")
        # samples/s async over ps = step ps / step async (the same samples per step)
        ratio(f"cluster_async_over_sync_straggler_{rate}", f"ps_straggler|2x2|{rate}", f"async_straggler|2x2|{rate}")
    timeline = _link_timeline.report(runs, line)
    if echo:
        print("\n".join(t for t in timeline if t.startswith("#")), flush=True)
    return out + timeline


def plot(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, path: Path) -> None:
    """Step time against link rate, one line per strategy, one panel per layout (and, for runs whose links were
    sampled, ``<path stem>_link.png``: :func:`benchmarks._link_timeline.plot`)."""
    _link_timeline.plot(runs, path.with_name(f"{path.stem}_link.png"))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.layouts), figsize=(6 * len(args.layouts), 4.5), squeeze=False)
    for ax, layout in zip(axes[0], args.layouts, strict=True):
        for name in [*args.strategies, *(f"{s}_straggler" for s in STRAGGLER)]:
            pts = [(parse_rate(rate) / 1e6, median([r["step_s"] for r in runs[k]]))
                   for rate in args.rates if (k := f"{name}|{layout}|{rate}") in runs]  # fmt: skip
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, marker="o", label=name, linestyle="--" if "straggler" in name else "-")
        ax.set(xscale="log", yscale="log", xlabel="link rate per node (Mbit/s, both ways)", ylabel="s / step",
               title=f"{layout} (nodes x processes), MLP D = 5.25 MB")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2x2 at 200mbit, ps, 1 round (CI)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps per fit, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--base-ms", type=float, default=100.0, help="the straggler runs' per-step compute")
    parser.add_argument("--backward-ms", type=float, default=0.0,
                        help="every fit's backward sleeps this long, over its layers (a heavier model)")  # fmt: skip
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=[s for s in STRATEGIES if s not in AB_ONLY],
    )
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--rates", nargs="+", default=list(RATES))
    parser.add_argument("--no-straggler", dest="straggler", action="store_false")
    parser.add_argument("--link-sample-ms", type=float, default=0.0,
                        help="> 0: each link's counters this often (the link_* lines)")  # fmt: skip
    parser.add_argument("--name", default="cluster_strategies", help="results/<name>.txt, .json and .png")
    parser.add_argument("--from-raw", type=Path, default=None,
                        help="measure nothing: the lines and the plot again from a stored results/*.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.from_raw is not None:
        raw = json.loads(args.from_raw.read_text())
        for key in ("strategies", "layouts", "rates"):
            setattr(args, key, raw["args"][key])
        print(raw["header"], flush=True)
        print(f"# replayed from {args.from_raw.name}: {sum(len(v) for v in raw['runs'].values())} runs", flush=True)
        report(raw["runs"], args)
        plot(raw["runs"], args, RESULTS / f"{args.from_raw.stem}.png")
        return 0
    args.failed = []
    if args.quick:
        # the machinery once, on the strategy with the most moving parts; the flat ring's bytes on each NIC
        # of the same 2x2 cluster are tests/integration/test_emulated_cluster.py's
        args.rounds, args.layouts, args.rates, args.strategies, args.straggler = 1, ["2x2"], ["200mbit"], [
            "ps"], False  # fmt: skip
        args.link_sample_ms = args.link_sample_ms or 4.0  # the link timeline's machinery too
    started = report_start("cluster_strategies: every strategy on an emulated cluster (namespaces, HTB-shaped links)")
    if started is None:
        return 0
    text = started
    start = time.monotonic()

    def store(runs: dict[str, list[dict[str, Any]]], final: bool = False) -> list[str]:
        lines = report(runs, args, echo=final)
        tail = [f"# failed runs: {', '.join(args.failed)}"] if args.failed else []
        tail += [load_line("end" if final else "now"),
                 f"# {time.monotonic() - start:.0f} s in all; {args.rounds} round(s), {args.steps} steps per fit "
                 f"({args.warmup} warm-up)" + (f"; backward {args.backward_ms:g} ms longer" if args.backward_ms else "")
                 + ("" if final else "; PARTIAL: the run was still going")]  # fmt: skip
        if not args.quick:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"{args.name}.txt").write_text("\n".join([*text, *lines, *tail]) + "\n")
            raw = {"args": vars(args), "header": text[0], "runs": runs}
            (RESULTS / f"{args.name}.json").write_text(json.dumps(raw))
        return tail

    runs = measure(args, text, store)
    print("\n".join(store(runs, final=True)), flush=True)
    if not args.quick:
        plot(runs, args, RESULTS / f"{args.name}.png")
    return 1 if args.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
