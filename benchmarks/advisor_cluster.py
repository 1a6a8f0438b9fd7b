"""The emulated cluster's runs the advisor is validated against, each with the CPU it got (a compute probe).

``cluster_strategies.py``'s fits (``run_one``: the MLP of ``benchmarks/emulated/_fit.py``, batch 32 per
replica, every strategy of the validation, pipeline K = P with M = 4K, tensor T = P), and right before
each fit a probe (``_compute_probe``): the MLP's forward + backward alone and on P processes at once,
and the advisor's own measurement of the MLP (``_mlp_measurement``: ``advisor.measure``, its blocks at the
batch and a quarter of it), which ``advisor_validation.py`` predicts the session from.
On this shared 2-vCPU machine the other jobs' load changes from fit to fit, and with it every CPU
cost of a step (compute, host work, a waiting process's wake-up); the probe says by how much, next to
the fit it belongs to, so that ``advisor_validation.py`` predicts each fit under the CPU it had
instead of the machine's quiet figures. Each fresh cluster also times one small message before its first fit
and after its last (``message_probe``: gloo's and RPC's, inside a node and between nodes, as the calibration
took them on loopback), the host's share of every message at the session's moment. Lines (medians over rounds):

    advisor_cluster_step_s_<strategy>_<layout>_<rate>           s; ``..._spread``: (max - min) / median
                                                                over the rounds' runs (one round: its timed steps)
    advisor_cluster_wall_s_per_step_<strategy>_<layout>_<rate>  s: the timed window's wall time over its steps
                                                                (the gaps between steps too: what a user waits
                                                                for, what the advisor predicts); ``..._spread``
                                                                over the rounds (0 with one round)
    advisor_cluster_probe_alone_ms_<layout>_<rate>, ..._together_ms_   the probes before the fits
    advisor_cluster_link_oneway_Bps_<layout>_<rate>            a TCP stream's goodput between nodes 0 and 1, per
                                                                fresh cluster (median over rounds)
    advisor_cluster_link_duplex_{min,mean}_over_oneway_<layout>_<rate>   a stream each way at once: the slower
                                                                direction's (the pair's mean) goodput over it
    advisor_cluster_message_us_<kind>_<layout>_<rate>         one small message's latency (``message_probe``,
                                                                before and after each cluster's fits, their median):
                                                                ``gloo_{intra,inter}`` per message, ``rpc_...`` a
                                                                4 KiB round trip; inside a node, between nodes

    flock /tmp/ls-timing.lock python benchmarks/advisor_cluster.py --rates 1gbit --layouts 2x2 --name NAME
    (NAME: advisor_cluster_<rate>_<layout>; one rate and layout per stored run: 2 rounds of 10 fits,
    6-20 min on 2 loaded cores)
    python benchmarks/advisor_cluster.py --quick     # 4x1 at 1gbit, the pipeline, 4 steps: nothing written (CI)

Writes ``results/<name>.txt`` (this output) and ``results/<name>.json`` (every run: its per-rank step
durations, NIC counters, probe and load). Skips with the reason (exit 0) where the cluster cannot be made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import line as emit
from benchmarks._common import load_average, load_line, median, spread
from benchmarks._compute_probe import ComputeProbe
from benchmarks._mlp_measurement import mlp_measurement, to_json
from benchmarks.cluster_strategies import LAYOUTS, RESULTS, run_one, schedule
from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.launch import launch, report_start

STRATEGIES = ("ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps1", "ps_ring", "async", "pipeline", "tensor")
PROBE = Path(__file__).with_name("_cluster_probe.py")
MESSAGE_PROBE = Path(__file__).with_name("emulated") / "_latency.py"
LINK_PROBE_S = 3.0


def message_probe(cluster: EmulatedCluster, per_node: int, timeout: float = 120.0) -> dict[str, float]:
    """One small message's latency on ``cluster`` now (``emulated/_latency.py``): gloo's per message and a
    4 KiB RPC round trip, inside a node (``..._intra``, with 2 or more per node) and between nodes 0 and 1
    (``..._inter``). Raises RuntimeError where the probe fails (its output in the message)."""
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp:
        out = Path(tmp) / "latency.json"
        result = launch(cluster, [sys.executable, str(MESSAGE_PROBE), "--out", str(out)], per_node=per_node,
                        timeout=timeout, echo=False)  # fmt: skip
        if result.returncode or not out.exists():
            tail = "".join(result.outputs)[-2000:]
            raise RuntimeError(f"the message probe exited with {result.returncode}:\n{tail}")
        return {k: float(v) for k, v in json.loads(out.read_text()).items()}


def link_probe(cluster: EmulatedCluster) -> dict[str, float]:
    """Goodput (payload B/s) between nodes 0 and 1: one TCP stream alone, then one each way at once.

    The presets state a link by one stream's goodput (``scale_cluster.py``); a ring, the sharded servers,
    tensor's all-reduces and the pipeline's 1F1B send and receive on a node's link at once, ps1's server
    receives, then sends. ``duplex_min``: the slower direction of the pair, ``duplex_mean`` their mean.
    """
    a, b = cluster.nodes[:2]
    py = sys.executable

    def streams(pairs: list[tuple[Any, Any, int]]) -> list[float]:
        recvs = [cluster.popen(dst, [py, str(PROBE), "stream-recv", dst.address, str(port)], stdout=subprocess.PIPE)
                 for _, dst, port in pairs]  # fmt: skip
        sends = [cluster.popen(src, [py, str(PROBE), "stream-send", dst.address, str(port), str(LINK_PROBE_S)],
                               stdout=subprocess.DEVNULL) for src, dst, port in pairs]  # fmt: skip
        for send in sends:
            send.wait(timeout=60)
        return [float(json.loads(r.communicate(timeout=60)[0])["goodput"]) for r in recvs]

    oneway = streams([(a, b, 5101)])[0]
    duplex = streams([(a, b, 5102), (b, a, 5103)])
    return {"oneway": oneway, "duplex_min": min(duplex), "duplex_mean": statistics.fmean(duplex)}


def probe_messages(cluster: EmulatedCluster, per_node: int, label: str, text: list[str]) -> dict[str, float]:
    """:func:`message_probe`, its figures printed and noted in ``text``; ``{}`` where it failed (noted: the fits
    go on without it, and the validation falls back to the presets' latencies)."""
    try:
        got = message_probe(cluster, per_node)
    except RuntimeError as err:
        text.append(f"# {label}: message probe FAILED: " + str(err).replace("\n", "\n#   "))
        print(text[-1], flush=True)
        return {}
    text.append(f"# {label}: message probe, us: " + ", ".join(f"{k} {1e6 * v:.0f}" for k, v in sorted(got.items())))
    print(text[-1], flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2, help="every fit again on a fresh cluster: the floor")
    parser.add_argument("--steps", type=int, default=12, help="steps per fit, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--first-round", type=int, default=0,
                        help="the first round's number (a round stored apart: its label and its strategies' order)")
    parser.add_argument("--fit-timeout", type=float, default=300.0,
                        help="seconds before a fit is stopped and counted as failed (a hung fit holds the lock)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--rates", nargs="+", default=["1gbit"])
    parser.add_argument("--name", default="advisor_cluster", help="results/<name>.txt and .json")
    parser.add_argument("--quick", action="store_true", help="4x1 at 1gbit, the pipeline, 4 steps; writes nothing")
    args = parser.parse_args(argv)
    if args.quick:
        # one strategy: test_emulated_cluster fits the ring through the same _fit.py, cluster_strategies' quick ps
        args.rounds, args.steps, args.layouts, args.rates, args.strategies = 1, 4, ["4x1"], ["1gbit"], ["pipeline"]
    started = report_start("advisor_cluster: the advisor's validation runs on the emulated cluster, with CPU probes")
    if started is None:
        return 0
    text, start = list(started), time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    failed: list[str] = []

    def store(final: bool) -> None:  # after every cluster: a run cut short keeps what it measured
        def line(name: str, value: float, unit: str) -> str:  # printed at the end only
            return emit(name, value, unit) if final else f"{name} {value:.4g} {unit}"

        lines = []
        for key, rs in runs.items():
            tag = key.replace("|", "_")
            lines.append(line(f"advisor_cluster_step_s_{tag}", median([r["step_s"] for r in rs]), "s"))
            values = [r["step_s"] for r in rs] if len(rs) > 1 else rs[0]["steps_s"]
            lines.append(line(f"advisor_cluster_step_s_{tag}_spread", spread(values), "x"))
            walls = [r["wall_s"] for r in rs if "wall_s" in r]
            if walls:  # what a user waits for: the steps and the time between them
                lines.append(line(f"advisor_cluster_wall_s_per_step_{tag}", median(walls), "s"))
                lines.append(line(f"advisor_cluster_wall_s_per_step_{tag}_spread", spread(walls), "x"))
            lines.append(line(f"advisor_cluster_probe_alone_ms_{tag}", 1e3 * median([r["probe"][0] for r in rs]), "ms"))
            lines.append(line(f"advisor_cluster_probe_together_ms_{tag}", 1e3 * median([r["probe"][1] for r in rs]),
                              "ms"))  # fmt: skip
        sessions: dict[str, list[dict[str, float]]] = defaultdict(list)
        for key, rs in runs.items():
            for r in rs:
                if "link" in r and r["link"] not in sessions[key.split("|", 1)[1]]:
                    sessions[key.split("|", 1)[1]].append(r["link"])
        for session, links in sessions.items():
            tag = session.replace("|", "_")
            lines.append(line(f"advisor_cluster_link_oneway_Bps_{tag}", median([x["oneway"] for x in links]), "B/s"))
            lines.append(line(f"advisor_cluster_link_duplex_min_over_oneway_{tag}",
                              median([x["duplex_min"] / x["oneway"] for x in links]), "x"))  # fmt: skip
            lines.append(line(f"advisor_cluster_link_duplex_mean_over_oneway_{tag}",
                              median([x["duplex_mean"] / x["oneway"] for x in links]), "x"))  # fmt: skip
        probed: dict[str, list[dict[str, float]]] = defaultdict(list)  # every cluster's message probes, once
        for key, rs in runs.items():
            for r in rs:
                for got in r.get("messages", []):
                    if got and all(got is not x for x in probed[key.split("|", 1)[1]]):
                        probed[key.split("|", 1)[1]].append(got)
        for session, got in probed.items():
            for kind in sorted({k for g in got for k in g}):
                values = [g[kind] for g in got if kind in g]
                lines.append(line(f"advisor_cluster_message_us_{kind}_{session.replace('|', '_')}",
                                  1e6 * median(values), "us"))  # fmt: skip
        tail = [f"# failed runs: {', '.join(failed)}"] if failed else []
        tail += [load_line("end" if final else "now"),
                 f"# {time.monotonic() - start:.0f} s in all; {args.rounds} round(s), {args.steps} steps per fit "
                 f"({args.warmup} warm-up)" + ("" if final else "; PARTIAL: the run was still going")]  # fmt: skip
        if args.quick:
            if final:
                print("\n".join(tail), flush=True)
            return
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.txt").write_text("\n".join([*text, *lines, *tail]) + "\n")
        slim = {k: [{x: v for x, v in r.items() if x != "records"} for r in rs] for k, rs in runs.items()}
        (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "header": text[0], "runs": slim}))
        if final:
            print("\n".join(tail), flush=True)

    world = {name: n * per for name, (n, per) in LAYOUTS.items()}
    probes = {p: ComputeProbe(p) for p in {world[layout] for layout in args.layouts}}
    try:
        measure(args, runs, text, failed, probes, store)
    finally:
        for probe in probes.values():
            probe.close()
    store(final=True)
    return 1 if failed else 0


def measure(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], text: list[str], failed: list[str],
            probes: dict[int, ComputeProbe], store: Callable[[bool], None]) -> None:  # fmt: skip
    """Every (layout, rate) on a fresh cluster, the strategies rotated per round; a probe before each fit."""
    for r0, rate, layout, rotated in schedule(args):
        r, shift = r0 + args.first_round, args.first_round % len(rotated)
        order = [*rotated[shift:], *rotated[:shift]]
        nodes, per_node = LAYOUTS[layout]
        probe = probes[nodes * per_node]
        with EmulatedCluster(nodes=nodes, rate=rate) as cluster:
            link = link_probe(cluster)
            text.append(f"# round {r} {layout} {rate}: link probe, one stream {link['oneway']:.4g} B/s; one each "
                        f"way at once: {link['duplex_min']:.4g} slower, {link['duplex_mean']:.4g} mean")  # fmt: skip
            print(text[-1], flush=True)
            messages = [probe_messages(cluster, per_node, f"round {r} {layout} {rate} before the fits", text)]
            for strategy in order:
                alone, together = probe()
                own = to_json(mlp_measurement())  # the advisor's own measurement, at the probe's moment
                load = load_average()
                try:
                    run = run_one(cluster, strategy, per_node, steps=args.steps, warmup=args.warmup,
                                  timeout=args.fit_timeout)  # fmt: skip
                except RuntimeError as err:
                    text.append(f"# round {r} {strategy} {layout} {rate}: FAILED: "
                                + str(err).replace("\n", "\n#   "))  # fmt: skip
                    print(text[-1], flush=True)
                    failed.append(f"{strategy}|{layout}|{rate}")
                    continue
                run.update(probe=(alone, together), measurement=own, load=load, link=link, round=r, messages=messages)
                runs[f"{strategy}|{layout}|{rate}"].append(run)
                text.append(f"# round {r} {strategy} {layout} {rate}: {run['step_s']:.4f} s/step, probe "
                            f"{1e3 * alone:.2f} ms alone, {1e3 * together:.2f} ms on {probe.world} at once, "
                            f"{run['wall_s']:.4f} s wall/step, {run['seconds']:.0f} s wall, load {load}")  # fmt: skip
                print(text[-1], flush=True)
                store(False)  # after every fit: a run cut short keeps what it measured
            if not args.quick:  # (CI: one probe, ~20 s of torchrun on 2 cores)
                messages.append(probe_messages(cluster, per_node, f"round {r} {layout} {rate} after the fits", text))
        store(False)


if __name__ == "__main__":
    raise SystemExit(main())
