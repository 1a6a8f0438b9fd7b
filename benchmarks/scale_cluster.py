"""The scale model validated on the emulated cluster: every cell of ``cluster_strategies.py`` predicted.

The model (``benchmarks/_scale_cluster_model.py``): step = compute + busiest-NIC bytes / goodput +
messages x latency (one server's bytes counted both ways: it receives, then sends). Its link
constants are measured here, per rate, on a fresh 2-node ``EmulatedCluster``: the payload goodput
of a TCP stream from node 0 to node 1 (``_cluster_probe.py``), and half the median round trip of a
64-byte ping-pong. Its compute term, per (strategy, layout), is calibrated from the run at the
fastest rate (1gbit), so the slower rates' cells are predictions and the fastest rate's are fitted
(error 0 by construction, printed but never counted). The measured steps come from
``results/cluster_strategies.json`` (the raw runs ``cluster_strategies.py`` stores), or, where
that file is missing, from this script's own reduced run (``--measure``:
``cluster_strategies.measure`` over every cell, stored raw in
``results/scale_cluster_runs.json``). Lines:

    scale_cluster_goodput_<rate>                             B/s, the stream's payload rate
    scale_cluster_latency_<rate>                             s, one way
    scale_measured_step_s_cluster_<strategy>_<layout>_<rate> s; ``..._spread``: (max - min) / median of
                                                             the run's timed steps (slowest rank)
    scale_predicted_step_s_cluster_<strategy>_<layout>_<rate>
    scale_comm_share_cluster_<...>                           the link term over the predicted step
    scale_model_error_cluster_<...>                          |predicted - measured| / measured
    ..._full_duplex                                          one server's cells with both directions at
                                                             once (the model counts them in series): the
                                                             bound from below
    scale_model_error_max_cluster                            over the cells where communication is at
                                                             least half the step (goal <= 0.15), with
                                                             ``..._spread_max``, the largest spread of
                                                             those cells, beside it

    python benchmarks/scale_cluster.py --measure   # measure every cell (1 round, ~1 h on 2 loaded cores), then model
    python benchmarks/scale_cluster.py --measure --strategies ring ps1 tensor   # what scale_cluster.txt holds
    python benchmarks/scale_cluster.py             # model the stored runs (probes ~1 min)
    python benchmarks/scale_cluster.py --quick     # the same, nothing written (CI)

Writes ``results/scale_cluster.txt`` (this output). Skips with the reason (exit 0) where the cluster
cannot be made.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, spread
from benchmarks._scale_cluster_model import (
    calibrate_compute,
    comm_seconds,
    critical_messages,
    predict_step,
    serial_directions,
)
from benchmarks.cluster_strategies import LAYOUTS, RATES, STRATEGIES, formula_over_d
from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.cluster import parse_rate

RESULTS = Path(__file__).parent / "results"
PROBE = Path(__file__).with_name("_cluster_probe.py")
GOAL = 0.15
STREAM_S = 3.0
PINGS = 200


def probe(rate: str) -> dict[str, float]:
    """The goodput (payload B/s) and one-way small-message latency between two nodes at ``rate``."""
    with EmulatedCluster(nodes=2, rate=rate) as cluster:
        a, b = cluster.nodes
        py = sys.executable
        recv = cluster.popen(b, [py, str(PROBE), "stream-recv", b.address, "5001"], stdout=subprocess.PIPE)
        send = cluster.popen(a, [py, str(PROBE), "stream-send", b.address, "5001", str(STREAM_S)],
                             stdout=subprocess.DEVNULL)
        send.wait(timeout=60)
        got = json.loads(recv.communicate(timeout=60)[0])
        echo = cluster.popen(b, [py, str(PROBE), "echo", b.address, "5002"])
        ping = cluster.popen(a, [py, str(PROBE), "ping", b.address, "5002", str(PINGS)], stdout=subprocess.PIPE)
        rtt = json.loads(ping.communicate(timeout=60)[0])
        echo.wait(timeout=30)
    return {"goodput": got["goodput"], "latency": rtt["rtt_median"] / 2}


def measure_cells(args: argparse.Namespace, log: list[str]) -> dict[str, Any]:
    """Every cell once, by ``cluster_strategies.measure``; the raw runs, stored."""
    from benchmarks import cluster_strategies

    ns = argparse.Namespace(rounds=1, layouts=list(args.layouts), rates=list(RATES), strategies=list(args.strategies),
                            straggler=False, steps=args.steps, warmup=args.warmup, base_ms=0.0, failed=[])  # fmt: skip
    RESULTS.mkdir(exist_ok=True)

    def save(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
        # after every cluster, so a run cut short keeps what it measured
        raw = {"args": dict(vars(ns)), "header": log[0], "runs": runs}
        (RESULTS / "scale_cluster_runs.json").write_text(json.dumps(raw))
        return raw

    return save(cluster_strategies.measure(ns, log, save))


def model(raw: dict[str, Any], links: dict[str, dict[str, float]], rates: Sequence[str]) -> list[str]:
    """The predicted-next-to-measured lines for every cell of ``raw``'s runs."""
    out: list[str] = []
    runs = raw["runs"]
    fast = max(rates, key=parse_rate)
    errors: list[tuple[float, float, str]] = []
    for strategy in STRATEGIES:
        for layout, (nodes, per_node) in LAYOUTS.items():
            base = runs.get(f"{strategy}|{layout}|{fast}")
            if not base:
                continue
            d = base[0]["D"]
            over_d = formula_over_d(strategy, nodes, per_node)
            # activations (pipeline, tensor): their volume does not depend on the rate, so the
            # bytes counted at the calibration rate stand for every rate
            nic = over_d * d if over_d is not None else median([r["nic_bytes"] for r in base])
            nic *= serial_directions(strategy)
            msgs = critical_messages(strategy, nodes, per_node)
            fast_comm = comm_seconds(nic, links[fast]["goodput"], msgs, links[fast]["latency"])
            compute = calibrate_compute(median([r["step_s"] for r in base]), fast_comm)
            for rate in rates:
                rs = runs.get(f"{strategy}|{layout}|{rate}")
                if not rs:
                    continue
                tag = f"cluster_{strategy}_{layout}_{rate}"
                cell = predict_step(compute, nic, links[rate]["goodput"], msgs, links[rate]["latency"])
                meas = median([r["step_s"] for r in rs])
                sp = spread([r["step_s"] for r in rs]) if len(rs) > 1 else spread(rs[0]["steps_s"])
                err = abs(cell.step_s - meas) / meas
                out.append(line(f"scale_measured_step_s_{tag}", meas, "s"))
                out.append(line(f"scale_measured_step_s_{tag}_spread", sp, "x"))
                out.append(line(f"scale_predicted_step_s_{tag}", cell.step_s, "s"))
                out.append(line(f"scale_comm_share_{tag}", cell.comm_s / cell.step_s, "x"))
                if rate != fast:  # a calibration cell's error is 0 by construction: not a measurement
                    out.append(line(f"scale_model_error_{tag}", err, "x"))
                if serial_directions(strategy) > 1:
                    # the bound the other way: both directions at once, compute refitted at the fast rate
                    one_way = nic / serial_directions(strategy)
                    fast_duplex = comm_seconds(one_way, links[fast]["goodput"], msgs, links[fast]["latency"])
                    duplex = predict_step(calibrate_compute(median([r["step_s"] for r in base]), fast_duplex),
                                          one_way, links[rate]["goodput"], msgs, links[rate]["latency"])  # fmt: skip
                    out.append(line(f"scale_predicted_step_s_{tag}_full_duplex", duplex.step_s, "s"))
                    if rate != fast:
                        out.append(line(f"scale_model_error_{tag}_full_duplex", abs(duplex.step_s - meas) / meas, "x"))
                if rate == fast:
                    out.append(f"# {tag}: the calibration cell (compute fitted here)")
                elif cell.comm_bound:
                    errors.append((err, sp, tag))
    if errors:
        worst = max(errors)
        out.append(line("scale_model_error_max_cluster", worst[0], "x"))
        out.append(line("scale_model_error_max_cluster_spread_max", max(e[1] for e in errors), "x"))
        out.append(f"# worst cell: {worst[2]} (error {worst[0]:.3f}, its spread {worst[1]:.3f}); "
                   f"{len(errors)} communication-bound cells; goal <= {GOAL}: "
                   f"{'met' if worst[0] <= GOAL else 'missed'}")  # fmt: skip
        within = [e for e in errors if e[0] <= GOAL]
        out.append(f"# cells within the goal: {len(within)} of {len(errors)}; over it: "
                   + ", ".join(f"{t} {e:.3f}" for e, _, t in sorted(errors, reverse=True) if e > GOAL))  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--measure", action="store_true", help="measure every cell first (1 round)")
    parser.add_argument("--runs", type=Path, default=None, help="raw runs json (default: see the docstring)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="model the stored runs, write nothing (CI)")
    args = parser.parse_args(argv)
    if args.quick and args.measure:
        parser.error("--quick models the stored runs: drop --measure")
    text = [header("scale_cluster: the scale model against every cell of cluster_strategies (emulated cluster)")]
    print(text[0], flush=True)
    ok, reason = EmulatedCluster.available()
    if not ok:
        print(f"# skipped: {reason}", flush=True)
        return 0
    text.append(load_line("start"))
    start = time.monotonic()
    source: Path | None
    if args.measure:
        raw = measure_cells(args, text)
        source = RESULTS / "scale_cluster_runs.json"
    else:
        stored = (RESULTS / "cluster_strategies.json", RESULTS / "scale_cluster_runs.json")
        source = args.runs or next((p for p in stored if p.exists()), None)
        if source is None:
            print("# found no raw runs: expected results/cluster_strategies.json. Fix: run it, or pass --measure")
            return 1
        raw = json.loads(source.read_text())
    text.append(f"# measured steps from {source.relative_to(RESULTS.parent.parent)}: {raw['header']}")
    rates = [r for r in RATES if any(k.endswith(f"|{r}") for k in raw["runs"])]
    links: dict[str, dict[str, float]] = {}
    for rate in rates:
        links[rate] = probe(rate)
        text.append(line(f"scale_cluster_goodput_{rate}", links[rate]["goodput"], "B/s"))
        text.append(line(f"scale_cluster_goodput_over_rate_{rate}", links[rate]["goodput"] * 8 / parse_rate(rate), "x"))
        text.append(line(f"scale_cluster_latency_{rate}", links[rate]["latency"], "s"))
    text += model(raw, links, rates)
    text.append(load_line("end"))
    text.append(f"# {time.monotonic() - start:.0f} s in all")
    print("\n".join(text[-2:]), flush=True)
    if not args.quick:  # the stored figures come from full runs only
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "scale_cluster.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
