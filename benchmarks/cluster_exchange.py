"""ps's exchange against ddp's all-reduce, bare, on the emulated cluster: the floor of ``cluster_ps_over_ddp``.

A parameter server's step moves the same bytes as a ring all-reduce (every process sends and receives
2(P-1)/P x D on P nodes of one process each), but as an all-to-all: every process pushes D/P to every
shard at once, and once every push is in, every shard answers every worker. This runs both transports
alone, no model and no Lightning (``benchmarks/emulated/_exchange.py``), on a fresh
:class:`~benchmarks.emulated.EmulatedCluster` per (round, rate), the patterns interleaved. Lines (medians
over every round's repetitions):

    exchange_s_<pattern>_<layout>_<rate>            s; patterns: allreduce (gloo), push (one direction of
                                                    ps's exchange), two_phase (push, barrier, pull: ps's
                                                    exchange), echo (each push answered at once), rs_ag
                                                    and a2a (the same exchange on gloo's collectives),
                                                    hier_push (the hierarchical push's flows between nodes)
    exchange_<pattern>_over_wire_<layout>_<rate>    that over the bytes' time at the link rate (push
                                                    (P-1)/P x D, hier_push 2(N-1)/N x D, every other
                                                    pattern 2(P-1)/P x D)
    exchange_hier_push_share_<layout>_<rate>        hier_push (ps's hierarchical push between nodes: local rank j
                                                    to local rank j of every other node, a barrier, the pull
                                                    back) per direction of a node's link over one stream's: the
                                                    2x2 presets' ``hier_push_share`` (nodes of more than one)
    exchange_allreduce_share_<layout>_<rate>        gloo's all-reduce's goodput per direction over one stream's
                                                    (``inter_gbps`` of the preset), its messages' latency
                                                    taken out: the presets' ``ring_share``
    exchange_{kernel,user}_cpu_s_<pattern>_<layout>_<rate>   the whole machine's CPU seconds per repetition in
                                                    the kernel (system, irq, softirq: the emulated links' veth
                                                    pairs, bridge and HTB among them) and in user space
    exchange_two_phase_over_allreduce_<layout>_<rate>   ps's transport over ddp's: the floor of
                                                    cluster_ps_over_ddp (#28) on these links
    exchange_echo_over_allreduce_<layout>_<rate>    the same without the shard's barrier
    exchange_rs_ag_over_allreduce_<layout>_<rate>   ps's exchange as gloo collectives (reduce-scatter, then
                                                    all-gather) over the all-reduce
    exchange_a2a_over_allreduce_<layout>_<rate>     ps's two phases as gloo all-to-alls over the all-reduce

    python benchmarks/cluster_exchange.py                       # 4x1 at 50mbit, 200mbit, 1gbit, 2 rounds
    python benchmarks/cluster_exchange.py --rates 50mbit --rounds 1
    python benchmarks/cluster_exchange.py --layouts 4x1 2x2 --name cluster_exchange_ring   # the presets' ring_share
    python benchmarks/cluster_exchange.py --layouts 2x2 --name cluster_exchange_hier       # ... and hier_push_share
    python benchmarks/cluster_exchange.py --quick               # 4x1 at 1gbit, 1 round of 2 reps; writes nothing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import line, load_average, load_line, median
from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.cluster import parse_rate
from benchmarks.emulated.launch import launch, report_start
from lightning_strategies.advisor import load_cluster
from lightning_strategies.advisor.costs import Costs, Link

RESULTS = Path(__file__).resolve().parent / "results"
WORKER = Path(__file__).resolve().parent / "emulated" / "_exchange.py"
LAYOUTS = {"4x1": (4, 1), "2x2": (2, 2)}
PATTERNS = ("allreduce", "push", "two_phase", "echo", "rs_ag", "a2a", "hier_push")
D_BYTES = 5_316_672


def run_one(cluster: EmulatedCluster, per_node: int, reps: int) -> dict[str, list[float]]:
    """One launch on ``cluster``: rank 0's times per pattern."""
    with tempfile.TemporaryDirectory(prefix="cluster-exchange-") as tmp:
        out = Path(tmp) / "times.json"
        argv = ["python", str(WORKER), "--bytes", str(D_BYTES), "--reps", str(reps), "--out", str(out)]
        result = launch(cluster, argv, per_node=per_node, timeout=600.0, echo=False)
        if result.returncode != 0 or not out.exists():
            tails = "\n".join(f"--- node {i}:\n{o[-2000:]}" for i, o in enumerate(result.outputs))
            raise RuntimeError(f"exchange on {len(cluster.nodes)}x{per_node} at {cluster.rate}: exit "
                               f"{result.returncode}\n{tails}")  # fmt: skip
        times: dict[str, list[float]] = json.loads(out.read_text())
        return times


def _link_share(link: Link, moved: float, seconds: float, messages: int) -> float:
    """``moved`` bytes each way through a node's link in ``seconds`` less ``messages`` messages' latency between
    nodes (which the advisor charges apart), over one stream's goodput: ``link``, the preset's (``inter_gbps``)."""
    return moved / (seconds - messages * link.latency_s) / link.bandwidth


def _preset(layout: str, rate: str) -> Costs:
    return load_cluster(f"emulated_{layout}_{rate}").costs(0.0)


def allreduce_share(seconds: float, layout: str, rate: str) -> float:
    """The bare all-reduce's share of the link: 2(P-1)/P x D each way, 2(P-1) messages per gloo segment of a
    D/P chunk. The presets' ``ring_share``."""
    nodes, per_node = LAYOUTS[layout]
    p = nodes * per_node
    costs = _preset(layout, rate)
    segments = math.ceil(D_BYTES / p / costs.gloo_segment_bytes)
    return _link_share(costs.inter, 2 * (p - 1) / p * D_BYTES, seconds, 2 * (p - 1) * segments)


def hier_push_share(seconds: float, layout: str, rate: str) -> float:
    """The hierarchical push's share of the link (the preset's RPC link): 2(N-1)/N x D each way, a push's and a
    pull's latency. The 2x2 presets' ``hier_push_share``."""
    nodes, _ = LAYOUTS[layout]
    return _link_share(_preset(layout, rate).rpc_inter, 2 * (nodes - 1) / nodes * D_BYTES, seconds, 2)


def report(runs: dict[str, dict[str, list[float]]]) -> list[str]:
    """The lines from ``{"layout|rate": {pattern: seconds}}``."""
    out = []
    for key, times in runs.items():
        layout, rate = key.split("|")
        nodes, per_node = LAYOUTS[layout]
        p = nodes * per_node
        wire = 2 * (p - 1) / p * D_BYTES * 8 / parse_rate(rate)  # s for 2(P-1)/P x D through one link
        med = {name: median(times[name]) for name in PATTERNS}
        node_wire = 2 * (nodes - 1) / nodes * D_BYTES * 8 / parse_rate(rate)  # hier_push: through a node's link
        for name in PATTERNS:
            out.append(line(f"exchange_s_{name}_{layout}_{rate}", med[name], "s"))
            out.append(line(f"exchange_{name}_over_wire_{layout}_{rate}",
                            med[name] / {"push": wire / 2, "hier_push": node_wire}.get(name, wire), "x"))  # fmt: skip
        if per_node > 1:
            share = hier_push_share(med["hier_push"], layout, rate)
            out.append(line(f"exchange_hier_push_share_{layout}_{rate}", share, "x"))
        share = allreduce_share(med["allreduce"], layout, rate)
        out.append(line(f"exchange_allreduce_share_{layout}_{rate}", share, "x"))
        out.append(line(f"exchange_two_phase_over_allreduce_{layout}_{rate}", med["two_phase"] / med["allreduce"], "x"))
        out.append(line(f"exchange_echo_over_allreduce_{layout}_{rate}", med["echo"] / med["allreduce"], "x"))
        for name in ("rs_ag", "a2a"):
            out.append(line(f"exchange_{name}_over_allreduce_{layout}_{rate}", med[name] / med["allreduce"], "x"))
        for name in PATTERNS:  # the machine's CPU per repetition, means (10 ms ticks: medians would round)
            for kind in ("kernel", "user"):
                if f"{name}:{kind}_cpu" in times:
                    cpu = times[f"{name}:{kind}_cpu"]
                    out.append(line(f"exchange_{kind}_cpu_s_{name}_{layout}_{rate}", sum(cpu) / len(cpu), "cpu_s"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2, help="a fresh cluster per round and rate")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each pattern per round")
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=["4x1"])
    parser.add_argument("--rates", nargs="+", default=["50mbit", "200mbit", "1gbit"])
    parser.add_argument("--name", default="cluster_exchange", help="results/<name>.txt and .json")
    parser.add_argument("--quick", action="store_true", help="4x1 at 1gbit, 1 round of 2 reps; writes nothing (CI)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.layouts, args.rates = 1, 2, ["4x1"], ["1gbit"]
    text = report_start("cluster_exchange: ps's all-to-all exchange against gloo's all-reduce, bare (emulated cluster)")
    if text is None:
        return 0
    start = time.monotonic()
    runs: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for rate in args.rates:
            for layout in args.layouts:
                nodes, per_node = LAYOUTS[layout]
                with EmulatedCluster(nodes=nodes, rate=rate) as cluster:
                    times = run_one(cluster, per_node, args.reps)
                key = f"{layout}|{rate}"
                for name, values in times.items():
                    runs.setdefault(key, {}).setdefault(name, []).extend(values)
                timed = ", ".join(f"{n} {median(v):.3f} s" for n, v in times.items() if ":" not in n)
                text.append(f"# round {r} {layout} {rate}: {timed} (load {load_average()})")
                print(text[-1], flush=True)
    lines = report(runs)
    tail = [load_line("end"), f"# {time.monotonic() - start:.0f} s in all; {args.rounds} round(s) x {args.reps} reps"]
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.txt").write_text("\n".join([*text, *lines, *tail]) + "\n")
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "header": text[0], "runs": runs}))
    print("\n".join(tail), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
