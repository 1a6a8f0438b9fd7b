"""A scale model: step time and bytes per link of every strategy, calibrated here, validated, projected.

The model (``lightning_strategies/advisor/model.py``, formulas in its docstring) predicts a step of ddp, ring
(flat and hierarchical), ps (P shards, hierarchical or flat push; one server), async and pipeline
from a few constants: per-message latency and bandwidth of the links (inside and between nodes),
host work per message and per byte, compute time, and the cores the processes share. On this 2-vCPU machine P = 3 or 4
processes (and other jobs) share the cores, so the model has a contention term, calibrated:
``contention(b) = max(1, b / cores)`` multiplies work that b processes do at once, with ``cores``
= P x (stand-in alone) / (stand-in on all P at once), measured in the same repetition.

1. Calibration and validation (``_scale_measure.py``): P = 2, 3, 4 fork-started CPU processes (gloo,
   TensorPipe RPC, 1 thread each) run the package's comm layer directly with a compute stand-in
   (fixed matmul work), not Lightning fits: the model is of the communication and its composition
   with compute; a fit adds Lightning's per-step hooks, logging and heartbeats, the same for every
   strategy and not a function of P, and at a few steps it would be all start-up. Each repetition
   runs the micro-benchmarks the constants come from and one timed run of every strategy, in a
   rotated order; worlds alternate P in rounds. Per repetition the model predicts each strategy
   from that repetition's constants; the error of a (strategy, P) is |median(predicted / measured)
   - 1| over the repetitions, and

       scale_model_error_max            the largest of them (goal <= 0.15)
       scale_model_error_<s>_P<n>       per run; scale_measured_step_s_ / scale_predicted_step_s_ medians
       scale_bytes_error_<s>_P<n>       bytes each worker sends per step, model vs measured: the
                                        strategies' own CommStats (ring, ps, ps_1, async) and the
                                        kernel's socket counters (wire_bytes.py's helpers: ddp, ring, ps_1)
       calib_*                          the calibrated constants (medians over repetitions)

   Two simulated nodes x 2 processes (two ``torchrun`` invocations on 127.0.0.1) run ddp, ring and,
   where ``comm.ring`` has it, the hierarchical ring: ``..._2x2`` lines.
2. Projection: ResNet-50 (25.6M fp32 gradients) on a stated cluster (``Cluster``: 8 GPUs per node,
   NVLink 300 GB/s, 100 Gb/s per node, latencies, A100 compute per step from NVIDIA's figure; every
   figure a flag, printed as ``cluster_*`` lines), host overheads (RPC, Python send/recv, pipeline
   chunks) as calibrated here unless given: ``projected_step_s_<s>_P<n>``, ``projected_link_bytes_``
   (busiest link, one direction, per step), ``projected_nic_bytes_`` (busiest node's NIC) and
   ``projected_server_bytes_ps_1_P<n>`` for P = 8 ... 1024 (``ps``: the hierarchical push across
   nodes, the strategy's default; ``ps_flat``: ``hierarchical=False``; ``ps_ring``: the shards on the ring's
   reduce-scatter and all-gather, hierarchical across nodes), and
   ``projected_efficiency_<ps|ps_flat|ps_ring|async>_P256_over_ddp`` (goal >= 0.9 for ps and async).
   Plots: ``results/scale.png`` (step time and scaling efficiency vs P), ``results/scale_traffic.png``
   (one server's traffic vs P against sharded ps and the rings), ``results/scale_validation.png``
   (predicted vs measured).

The parts: ``_scale_measure.py`` (the worlds' micro-benchmarks and timed runs), ``_scale_costs.py``
(their figures as the model's constants; the stated cluster), ``_scale_compare.py`` (the model against
the measured steps and bytes), ``_scale_plots.py`` (the figures); this file runs them and prints.

    python benchmarks/scale.py            # P = 2, 3, 4 + torchrun 2x2, 6 rounds (~4-10 min on 2 cores)
    python benchmarks/scale.py --quick    # P = 2, small N, 4 rounds, no torchrun (CI, < 60 s)
    python benchmarks/scale.py --nic-gbit-s 400 --gpus-per-node 4 --step-ms 60   # your cluster
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_average, load_line
from benchmarks._scale_compare import (
    GOAL,
    bytes_errors,
    compare,
    pooled_calibration,
    print_calibration,
    world_calibration,
)
from benchmarks._scale_costs import (
    STEP_SOURCE,
    Cluster,
    cluster_costs,
    cluster_workload,
    machine_costs,
)
from benchmarks._scale_measure import standin_iters, world_worker
from benchmarks._scale_plots import plot_from, plot_projection, plot_traffic, plot_validation
from benchmarks._workers import reserved_port, run_workers
from benchmarks.ps_traffic import resnet50_sizes
from lightning_strategies.advisor.model import Costs, Workload, predict

STRATEGIES_MEASURED = ("ddp", "ring", "ps", "ps_1", "async", "pipeline")
PROJECTED = tuple(2**k for k in range(3, 11))  # 8 ... 1024
PROJECTED_STRATEGIES = ("ddp", "ring", "ring_hier", "ps", "ps_flat", "ps_1", "ps_ring", "async", "pipeline")
#: ``projected_efficiency_<s>_P256_over_ddp``: the issue-28 goal for ps and async (>= 0.9); ps_ring (ps's shards on
#: the ring's halves) is reported next to them
OVER_DDP, OVER_DDP_AT, OVER_DDP_GOAL = ("ps", "ps_flat", "ps_ring", "async"), 256, 0.9
RESULTS = Path(__file__).parent / "results"


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


#: the strategies of each world kind (``_scale_measure``): without RPC, as the collectives and the
#: pipeline run; with it, as ps, ps_1 and async do
KINDS = {"coll": ("ddp", "ring", "pipeline"), "rpc": ("ps", "ps_1", "async")}
KIND_OF = {s: kind for kind, names in KINDS.items() for s in names} | {"ring_hier": "coll"}


def world_config(args: argparse.Namespace, sizes: Sequence[int], iters: int) -> dict:
    return {
        "sizes": list(sizes),
        "iters": iters,
        "steps": args.steps,
        "reps": args.reps,
        "calib_reps": args.calib_reps,
        "probe_reps": args.probe_reps,
        "wake_trials": args.wake_trials,
        "async_window_s": args.async_window,
        "pipeline": {"dim": args.pipe_dim, "blocks_per_stage": 2, "rows": args.pipe_rows, "microbatches": 4},
    }


def measure_worlds(
    cfg: dict, worlds: Sequence[int], rounds: int, timeout: float, between: Any = None
) -> dict[str, list[dict]]:
    """Repetitions by world (``"coll/P2"``, ``"rpc/P3"``, ...), each tagged with its round.

    ``rounds`` rounds, each running every (P, kind) world once, P in a rotated order and the kinds
    alternating, so that no world always runs at the same point of the machine's load; a round
    is a separate process world, so two rounds are two independent measurements of every cell.
    ``between(r)`` runs after round r (the torchrun worlds go there).
    """
    rows: dict[str, list[dict]] = {f"{kind}/P{p}": [] for kind in KINDS for p in worlds}
    for r in range(rounds):
        for i, p in enumerate([*worlds[r % len(worlds) :], *worlds[: r % len(worlds)]]):
            kinds = list(KINDS) if (r + i) % 2 == 0 else list(KINDS)[::-1]
            for kind in kinds:
                world_cfg = {
                    **cfg, "strategies": list(KINDS[kind]), "rpc": kind == "rpc", "rpc_port": reserved_port(),
                    "offset": r,
                }  # fmt: skip
                got = run_workers(world_worker, p, world_cfg, timeout=timeout, pg_timeout_s=180)[0]
                rows[f"{kind}/P{p}"].extend({**row, "round": r} for row in got)
                print(f"# round {r + 1}/{rounds}: {kind} P={p} done, load {load_average()}", flush=True)
        if between is not None:
            between(r)
    return rows


def measure_torchrun(cfg: dict, nodes: int, per_node: int, timeout: float) -> list[dict]:
    """The same repetitions in ``nodes`` torchrun invocations of ``per_node`` processes on 127.0.0.1."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    from _torchrun_utils import TORCHRUN, child_env, run_bounded

    script = Path(__file__).with_name("_scale_torchrun.py")
    port = reserved_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps({**cfg, "rpc_port": reserved_port(), "local_size": per_node}))
        commands = []
        for node in range(nodes):
            cmd = [
                *TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=static",
                "--master-addr=127.0.0.1", f"--master-port={port}", f"--node-rank={node}", "--max-restarts=0",
                str(script), str(cfg_path), str(out_path),
            ]  # fmt: skip
            commands.append((cmd, child_env(), Path(tmp) / f"node{node}.log"))
        run_bounded(commands, what="torchrun (scale)", timeout=timeout)
        return list(json.loads(out_path.read_text()))


def wire_bytes(sizes: Sequence[int], worlds: Sequence[int], cases: Sequence[str]) -> dict[tuple[str, int], float]:
    """Bytes the busiest worker sends per step on its sockets (the kernel's counters, wire_bytes.py)."""
    from benchmarks.wire_bytes import measure

    out = {}
    for world in worlds:
        for case in cases:
            out[(case, world)] = max(measure(case, world, sizes, steps=2).sent)
    return out


# --------------------------------------------------------------------------------------------
# Projection
# --------------------------------------------------------------------------------------------


def project(cluster: Cluster, calibrated: Costs) -> dict[str, dict[int, Any]]:
    costs, work = cluster_costs(cluster, calibrated), cluster_workload(cluster)
    out: dict[str, dict[int, Any]] = {s: {} for s in PROJECTED_STRATEGIES}
    for s in PROJECTED_STRATEGIES:
        for p in PROJECTED:
            out[s][p] = predict(s, costs, p, work)
    return out


def print_projection(cluster: Cluster, calibrated: Costs, proj: dict[str, dict[int, Any]]) -> None:
    used = cluster.resolved(calibrated)
    for name, value, unit in used.describe():
        line(f"cluster_{name}", value, unit)
    here = [f.name for f in fields(Cluster) if isinstance(f.default, float) and math.isnan(getattr(cluster, f.name))]
    if here:
        print(f"# cluster figures calibrated on this machine (host work of the same Python code): {here}", flush=True)
    print(f"# cluster_step_ms source: {STEP_SOURCE}", flush=True)
    for s, by_p in proj.items():
        for p, pred in by_p.items():
            line(f"projected_step_s_{s}_P{p}", pred.step_s, "s")
            line(f"projected_scaling_efficiency_{s}_P{p}", cluster.step_ms / 1e3 / pred.step_s, "x")
            line(f"projected_link_bytes_{s}_P{p}", pred.link_bytes, "bytes")
            line(f"projected_nic_bytes_{s}_P{p}", pred.nic_bytes, "bytes")
            line(f"projected_worker_bytes_{s}_P{p}", pred.busiest_sent_bytes, "bytes")
            if s == "ps_1":
                line(f"projected_server_bytes_ps_1_P{p}", pred.busiest_sent_bytes, "bytes")
            if pred.bound and pred.bound != "worker":
                print(f"# {s} P={p}: bound by the {pred.bound}", flush=True)
    ddp = proj["ddp"][OVER_DDP_AT].step_s
    for s in OVER_DDP:  # efficiency over ddp's = ddp's step over its step (the same compute)
        line(f"projected_efficiency_{s}_P{OVER_DDP_AT}_over_ddp", ddp / proj[s][OVER_DDP_AT].step_s, "x")
    print(f"# goal: projected_efficiency_ps_P{OVER_DDP_AT}_over_ddp and ..._async_... >= {OVER_DDP_GOAL}", flush=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="P = 2, small N, 4 rounds, no torchrun (CI)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4], help="validation world sizes P")
    parser.add_argument("--rounds", type=int, default=6, help="rounds; each runs every world once (even)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions per world and round")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per strategy run (after 1 warm-up)")
    parser.add_argument("--calib-reps", type=int, default=5, help="repetitions of each micro-benchmark (median)")
    parser.add_argument("--probe-reps", type=int, default=1, help="stand-in runs of the probe before each step")
    parser.add_argument("--n-div", type=int, default=4, help="N = ResNet-50's 25.6M / this (tensor shapes scaled)")
    parser.add_argument("--compute-ms", type=float, default=40.0, help="the compute stand-in, alone, per step")
    parser.add_argument("--async-window", type=float, default=0.6, help="seconds of each async timing window")
    parser.add_argument("--wake-trials", type=int, default=40, help="messages per wake-up calibration level")
    parser.add_argument("--save-raw", type=Path, default=None, help="write every measured repetition (JSON) here")
    parser.add_argument("--from-raw", type=Path, default=None, help="no step timing: the model on a --save-raw file")
    parser.add_argument("--pipe-dim", type=int, default=512, help="pipeline blocks' width (Linear + tanh)")
    parser.add_argument("--pipe-rows", type=int, default=64, help="pipeline micro-batch rows")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the 2 nodes x 2 torchrun run")
    parser.add_argument("--torchrun", action="store_true", help="run the 2 nodes x 2 torchrun run with --quick too")
    parser.add_argument("--no-wire", action="store_true", help="skip the kernel byte counts")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per world")
    parser.add_argument("--plot-from", type=Path, default=None, help="only redraw the figures from a stored output")
    for f in fields(Cluster):
        default = f.default
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(default), default=default, help=f"cluster: {f.name}"
        )
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.rounds, args.steps, args.calib_reps, args.n_div = [2], 2, 3, 3, 64
        args.wake_trials = 20
        args.compute_ms, args.async_window, args.pipe_dim, args.pipe_rows = 8.0, 0.3, 128, 16
        args.no_torchrun = not args.torchrun
    return args


def report(
    tag: str,
    got: dict[str, dict],
    errors: dict[str, float],
    spreads: dict[str, float],
    model_spreads: dict[str, float],
    results: list,
) -> None:
    """The lines of one validation world (``tag``: ``P2`` ... or ``2x2``).

    ``scale_measurement_spread_<s>_<tag>``: |A - B| / median of the cell's measured medians in the
    even and the odd rounds, two independent measurements of the same step: how far a measured
    median moves between runs on this machine, which no model of the step can follow.
    ``scale_model_error_spread_``: the same for the model's error (|ratio A - ratio B|).
    """
    for s, r in got.items():
        name = f"{s}_{tag}"
        line(f"scale_measured_step_s_{name}", r["measured"], "s")
        line(f"scale_predicted_step_s_{name}", r["predicted"], "s")
        line(f"scale_predicted_over_measured_{name}", r["ratio"], "x")
        errors[name] = abs(r["ratio"] - 1)
        line(f"scale_model_error_{name}", errors[name], "fraction")
        line(f"scale_load_{name}", r["load"], "load")
        if len(r["halves"]) == 2:
            (ma, ra), (mb, rb) = r["halves"]
            spreads[name] = abs(ma - mb) / r["measured"]
            model_spreads[name] = abs(ra - rb)
            line(f"scale_measurement_spread_{name}", spreads[name], "fraction")
            line(f"scale_model_error_spread_{name}", model_spreads[name], "fraction")
        else:
            print(f"# {name}: measured in one round only, no spread", flush=True)
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["phases"].items())
        q = statistics.quantiles(r["ratios"], n=4) if len(r["ratios"]) > 1 else [r["ratio"]] * 3
        print(
            f"# {name}: predicted ms {parts}; predicted / measured over {len(r['ratios'])} steps in "
            f"{r['rounds']} rounds: quartiles {q[0]:.2f} {q[1]:.2f} {q[2]:.2f}",
            flush=True,
        )
        results.append((s, tag, r))


def validate(
    rows: dict[str, list[dict]],
    worlds: Sequence[int],
    sizes: Sequence[int],
    pipe: dict,
    errors: dict[str, float],
    spreads: dict[str, float],
    model_spreads: dict[str, float],
    results: list,
    bytes_err: dict[str, float],
) -> None:
    """Model against measurement for every fork-started world: each kind's calibration predicts its
    own strategies (the calibration figures and the validated steps are separate runs)."""
    for world in worlds:
        got: dict[str, dict] = {}
        for kind, strategies in KINDS.items():
            world_rows = rows[f"{kind}/P{world}"]
            calib = world_calibration(rows, kind, world)
            part, costs = compare(world_rows, calib, world, strategies, sizes, pipe)
            got.update(part)
            line(f"calib_effective_cores_{kind}_P{world}", statistics.median(c.cores or 0.0 for c in costs), "cores")
            base = calib["compute_s"]
            line(f"calib_machine_slowdown_{kind}_P{world}", statistics.median(c.compute_s / base for c in costs), "x")
            work = Workload(grad_bytes=4.0 * sum(sizes), tensors=len(sizes))
            print_calibration(
                machine_costs(
                    {**calib, "microbatches": float(pipe["microbatches"])}, world, tensors=work.tensors,
                    grad_bytes=work.grad_bytes,
                ),
                f"_{kind}_P{world}", (kind,),
            )  # fmt: skip
        ordered = {s: got[s] for s in STRATEGIES_MEASURED if s in got}
        report(f"P{world}", ordered, errors, spreads, model_spreads, results)
        bytes_err.update(bytes_errors(rows[f"rpc/P{world}"] + rows[f"coll/P{world}"], world, sizes, f"P{world}"))


def load_rows(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.plot_from is not None:
        plot_from(args.plot_from)
        return 0
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(header("scale: a calibrated model of step time and bytes per link (CPU, gloo + TensorPipe)"), flush=True)
    print(load_line("start"), flush=True)
    sizes = [max(1, s // args.n_div) for s in resnet50_sizes()]
    n = sum(sizes)
    line("params_N", n, "floats")
    if args.from_raw is not None:  # the model again on stored measurements (no measuring)
        raw = load_rows(args.from_raw)
        cfg, rows, tr_rows = raw["cfg"], raw["rows"], raw["torchrun"]
        print(f"# measurements from {args.from_raw} ({raw['header']})", flush=True)
    else:
        iters = standin_iters(args.compute_ms / 1e3)
        cfg = world_config(args, sizes, iters)
        print(f"# compute stand-in: {iters} matmuls of 256x256 (+tanh), ~{args.compute_ms:g} ms alone", flush=True)
        tr_rows = []
        tr_cfg = {**cfg, "strategies": ["ddp", "ring", "ring_hier"], "reps": max(1, args.rounds // 2)}

        def torchrun_after(r: int) -> None:
            # two invocations, after the middle round and after the last: the A and B of the 2 x 2 cells
            if not args.no_torchrun and r in (args.rounds // 2 - 1, args.rounds - 1):
                half = 1 if tr_rows else 0
                got = measure_torchrun({**tr_cfg, "offset": r}, nodes=2, per_node=2, timeout=args.timeout)
                tr_rows.extend({**row, "round": half} for row in got)
                print(f"# torchrun 2x2 after round {r + 1} done, load {load_average()}", flush=True)

        rows = measure_worlds(cfg, args.worlds, args.rounds, args.timeout, between=torchrun_after)
        if args.save_raw is not None:
            args.save_raw.write_text(json.dumps({"header": header("scale raw"), "cfg": cfg, "rows": rows,
                                                 "torchrun": tr_rows}))  # fmt: skip
            print(f"# raw measurements: {args.save_raw}", flush=True)
    worlds = sorted({int(k.partition("/P")[2]) for k in rows})
    errors: dict[str, float] = {}
    spreads: dict[str, float] = {}
    model_spreads: dict[str, float] = {}  # |ratio A - ratio B|: how far the model's error moves between halves
    bytes_err: dict[str, float] = {}
    results: list[tuple[str, str, dict]] = []
    pipe = cfg["pipeline"]
    print(
        "# calibration runs: each world's calib/ figures (micro-benchmarks: compute alone and all at once, "
        "wake-ups, links, tiny protocol calls, transports at the runs' sizes, host work); validation runs: "
        "the strategies' timed steps",
        flush=True,
    )
    validate(rows, worlds, sizes, pipe, errors, spreads, model_spreads, results, bytes_err)
    every_row = [row for rows_ in rows.values() for row in rows_]
    merged = pooled_calibration(every_row)
    calibrated = machine_costs({**merged, "microbatches": float(pipe["microbatches"])}, 2, tensors=len(sizes),
                               grad_bytes=4.0 * n)  # fmt: skip
    if tr_rows:
        tr_strategies = ["ddp", "ring", "ring_hier"]
        tr_calib = pooled_calibration(tr_rows)
        got, _ = compare(tr_rows, tr_calib, 4, tr_strategies, sizes, pipe, local_size=2)
        report("2x2", got, errors, spreads, model_spreads, results)
        bytes_err.update(bytes_errors(tr_rows, 4, sizes, "2x2", local_size=2))
    if not args.no_wire:  # counted on a replay too (--from-raw): bytes, not timings; quick and load-independent
        wire_worlds, cases = ((2,), ("ddp", "ring")) if args.quick else (tuple(args.worlds), ("ddp", "ring", "ps_1"))
        wire_sizes = [max(1, s // 4) for s in sizes]  # bytes scale with N: a quarter is as exact
        for (case, world), got_bytes in wire_bytes(wire_sizes, wire_worlds, cases).items():
            want = predict(case, calibrated, world, Workload(grad_bytes=4.0 * sum(wire_sizes))).busiest_sent_bytes
            tag = f"{case}_P{world}"
            line(f"scale_wire_bytes_sent_{tag}", got_bytes, "bytes")
            bytes_err[f"wire_{tag}"] = abs(got_bytes / want - 1)
            line(f"scale_wire_bytes_error_{tag}", bytes_err[f"wire_{tag}"], "fraction")
    line("scale_bytes_error_max", max(bytes_err.values()), "fraction")
    for s in dict.fromkeys(s for s, _, _ in results):
        cells = [k for k in errors if k.rpartition("_")[0] == s]
        line(f"scale_model_error_max_{s}", max(errors[k] for k in cells), "fraction")
        if any(k in spreads for k in cells):
            line(f"scale_measurement_spread_max_{s}", max(spreads[k] for k in cells if k in spreads), "fraction")
    line("scale_model_error_max", max(errors.values()), "fraction")
    worst = max(errors, key=lambda k: errors[k])
    print(f"# goal: scale_model_error_max <= {GOAL}; worst: {worst}", flush=True)
    if spreads:
        line("scale_measurement_spread_max", max(spreads.values()), "fraction")
        line("scale_model_error_spread_max", max(model_spreads.values()), "fraction")
        widest = max(spreads, key=lambda k: spreads[k])
        print(f"# the measurement's own run-to-run spread (even vs odd rounds), widest: {widest}", flush=True)
        meets = [s for s in dict.fromkeys(s for s, _, _ in results)
                 if all(errors[k] <= GOAL for k in errors if k.rpartition("_")[0] == s)]  # fmt: skip
        print(f"# strategies within the goal at every P: {meets}", flush=True)
    cluster = Cluster(**{f.name: getattr(args, f.name) for f in fields(Cluster)})
    # the projection's host overheads: every figure's least disturbed value (a cluster's host is not
    # shared with other jobs)
    unshared_calib = pooled_calibration(every_row, latency_median=False)
    unshared = machine_costs({**unshared_calib, "microbatches": float(pipe["microbatches"])}, 2, tensors=len(sizes),
                             grad_bytes=4.0 * n)  # fmt: skip
    proj = project(cluster, unshared)
    print_projection(cluster, unshared, proj)
    if not args.quick and args.from_raw is None:
        plot_projection(cluster, proj, RESULTS / "scale.png")
        plot_traffic(cluster, proj, RESULTS / "scale_traffic.png")
        plot_validation(results, RESULTS / "scale_validation.png")  # (--plot-from redraws them from the output)
    print(load_line("end"), flush=True)
    print(f"# wall {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
