"""The pipeline strategy's claims: its bubble, its activation memory, balance="time", its step time.

K = 2 fork-started CPU processes joined by gloo, one torch thread each, run the strategy's own
:class:`~lightning_strategies.comm.pipeline.PipelineRuntime` (the code ``"pipeline"``
runs under Lightning). Prints a header (machine, versions, date), then ``name value unit`` lines.
The blocks are in ``_pipeline_models.py``, the measurements in ``_pipeline_measure.py``, the
timeline analysis in :mod:`lightning_strategies.comm.pipeline`.

**Simulated device compute (the goal lines).** Two processes on a shared 2-vCPU machine fight
for the cores, so a compute-bound stage's time depends on the other load, not on the schedule.
The main figures therefore use *simulated* blocks: each is a small Linear + tanh (real
parameters, gradients and transfers) followed by a custom autograd function that sleeps
``cost x sim_ms`` in forward and twice that in backward, in proportion to the micro-batch's
rows: a stand-in for a GPU kernel the CPU waits on. Sleeping stages need no core, so two of
them overlap as two devices would. Every line computed on them says ``sim`` in the header
comment; the ``real_`` lines repeat the measurements with compute-bound blocks (Linear + tanh,
``--dim`` wide) as context.

    bubble_over_theory_{gpipe,1f1b}_M{M}   measured idle share / (K-1)/(M+K-1)      goal <= 1.15
    floor_bubble_over_theory_...            the same for a bare gloo loop of equal stages (below)
    bubble_over_floor_...                   measured idle share / the bare loop's
    idle_{gpipe,1f1b}_M{M}                  1 - compute / step span, measured (what the strategy logs)
    schedule_bubble_over_theory_...         the schedule's fill/drain alone (replay) / theory
    schedule_bubble_{gpipe,1f1b}_M{M}       the schedule's bubble fraction (replay of the recorded order)
    jitter_{gpipe,1f1b}_M{M}                share of the span lost to chunks the host stalled
    overhead_{gpipe,1f1b}_M{M}              share of the span spent between chunks: transfers, Python
    span_{gpipe,1f1b}_M{M}                  step time (ms)
    peak_activation_1f1b_over_gpipe_M{M}    stage 0's peak saved activations, 1F1B / GPipe
    peak_activation_theory_M{M}             K/M                                     goal: within 10%
    balance_time_over_params                step time, balance="time" / "params"    goal < 1
    balance_theory_time_over_params         the same ratio predicted from the block costs
    pipeline_step_over_unsplit              Lightning step, "pipeline" (K=2) / one process
    pipeline_step_theory_over_unsplit       (M+K-1) / (M K)

**How the bubble is measured.** Each rank records the start and end of every forward and
backward chunk, and of the last stage's loss (one ``time.perf_counter`` clock for all processes
of the machine); a barrier
starts every step and the step's span runs from the first rank's start to the last rank's end.
``idle`` is the share of the span a stage does not compute, averaged over stages: what the
strategy logs as ``pipeline/bubble_fraction``, and the measured bubble the goal line divides by
the theory. It holds three things, each measured apart:

- the schedule's fill and drain, the theory's bubble: the chunks are replayed in their recorded
  order, each lasting its stage's median forward, backward or loss over the setting's timed steps,
  with no time between them (a chunk starts when its stage is free and its input, the previous
  stage's forward or the next stage's backward of the same micro-batch, is done).
  ``schedule_bubble`` = 1 - compute / span of that timeline (a check of the schedule's order and
  of stage balance: with equal stages it equals the theory by construction, so it is context,
  not the goal). With equal stages it is (K-1)/(M+K-1); a stage slower
  than the other raises it (the last stage's loss; the real blocks below, when one process
  gets less of the CPU), by about M x the difference per micro-batch.
- ``jitter``: replayed with the measured durations instead, the span grows by what slow chunks
  (the host's other load stalling a process inside a chunk, time ``idle`` counts as compute)
  cost the pipeline.
- ``overhead``: the rest of the real span: transfers and Python between chunks.

**The transport's floor.** After each timed step every rank runs the order of chunks that step
recorded once more, bare: a gloo ``irecv`` posted when the chunk is due, a sleep of the typical
forward or backward chunk (the median over all stages, so the stages are equal), an ``isend``
not waited for; no schedule object, no autograd, no loss. Its idle share over the theory is
what the transfers, posted as the schedules post them, and a Python loop cost on this machine;
a runtime issuing the same transfers does not get below it, and ``bubble_over_floor`` is what the
strategy's runtime adds (stage bookkeeping, the last stage's loss, unequal stages).

Activations are counted by ``torch.autograd.graph.saved_tensors_hooks`` on stage 0: the bytes of
distinct non-parameter tensors saved for backward and still alive, peak over the step.

``balance_time_over_params`` uses a deliberately unbalanced model: two blocks of cost 8 with few
parameters and two of cost 1 with 5x more (a Linear plus a table of 4 x width rows read at one
row). Splitting by parameters puts both heavy blocks on one stage (17 : 1); timing them splits
the work 8 : 10. The predicted ratio replays the recorded schedules with the nominal costs.

``pipeline_step_over_unsplit`` fits the same simulated 4-block model with Lightning, under
``PipelineStrategy`` (1F1B, 2 fork-started processes) and on one process, alternating the two so
both see the same machine load; a fit's step time is its fastest per-batch wall time (hooks
``on_train_batch_start`` to ``on_train_batch_end`` on rank 0, the first two steps skipped): the
host's stalls of a sleeping process only ever add to a step, and the ratio is the median over
the rounds.

    python benchmarks/pipeline.py            # 7 repetitions (about 4 minutes)
    python benchmarks/pipeline.py --quick    # 1 repetition, smaller blocks (CI smoke run)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, pyplot, save_figure
from benchmarks._pipeline_measure import MICROBATCHES, K, lightning_step_ratio, measure
from benchmarks._workers import run_workers

# -- main -------------------------------------------------------------------------------------------


def run_world(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """K forked processes with a gloo group; rank 0's results (killed past ``timeout``)."""
    return dict(run_workers(measure, K, cfg, timeout=timeout)[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 repetition, smaller blocks (CI smoke run)")
    # 2 cost-1 blocks per stage: 20 ms forward + 40 ms backward per micro-batch and stage, long
    # against what is not compute (transfers and Python between chunks, the last stage's loss)
    parser.add_argument(
        "--sim-ms", type=float, default=10.0, help="simulated forward ms of a cost-1 block per micro-batch"
    )
    parser.add_argument("--sim-dim", type=int, default=256, help="width of the simulated blocks")
    parser.add_argument("--sim-microbatch", type=int, default=32, help="samples per micro-batch (simulated)")
    parser.add_argument("--dim", type=int, default=1024, help="width of the real-compute blocks")
    parser.add_argument("--microbatch", type=int, default=64, help="samples per micro-batch (real compute)")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per setting (median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated Lightning fits per side")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the measurements in workers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, m = 10, 4
    if args.quick:
        args.sim_ms, args.sim_dim, args.dim, args.microbatch, args.reps, args.rounds = 1.0, 64, 256, 16, 1, 1
        steps = 4
    cfg = {
        "sim_ms": args.sim_ms, "sim_dim": args.sim_dim, "sim_microbatch": args.sim_microbatch, "dim": args.dim,
        "microbatch": args.microbatch, "reps": args.reps, "real_reps": max(1, (args.reps + 1) // 2),
    }  # fmt: skip
    print(header(f"pipeline: K={K} CPU processes (gloo, 1 thread each)"), flush=True)
    print(load_line("start"), flush=True)
    print(
        f"# sim: simulated device compute, blocks {args.sim_dim} wide sleeping {args.sim_ms:g} ms x cost per "
        f"micro-batch of {args.sim_microbatch} in forward, 2x in backward; real_: Linear+tanh {args.dim} wide, "
        f"micro-batch {args.microbatch}",
        flush=True,
    )
    r = run_world(cfg, args.timeout)
    r.update({f"lightning_{k}": v for k, v in lightning_step_ratio(cfg, args.rounds, steps, m).items()})
    for prefix in ("", "real_"):
        for schedule in ("gpipe", "1f1b"):
            for mm in MICROBATCHES:
                theory = (K - 1) / (mm + K - 1)
                idle, bubble = r.get(f"{prefix}idle_{schedule}_M{mm}"), r.get(f"{prefix}bubble_{schedule}_M{mm}")
                if idle is not None and bubble is not None:
                    line(f"{prefix}bubble_over_theory_{schedule}_M{mm}", idle / theory, "x")
                    line(f"{prefix}schedule_bubble_over_theory_{schedule}_M{mm}", bubble / theory, "x")
                floor = r.get(f"{prefix}floor_idle_{schedule}_M{mm}")
                if idle is not None and floor is not None:
                    line(f"{prefix}floor_bubble_over_theory_{schedule}_M{mm}", floor / theory, "x")
                    line(f"{prefix}bubble_over_floor_{schedule}_M{mm}", idle / floor, "x")
        units = {"idle": "fraction", "bubble": "fraction", "jitter": "fraction", "overhead": "fraction", "span": "ms"}
        for key, unit in units.items():
            for schedule in ("gpipe", "1f1b"):
                for mm in MICROBATCHES:
                    name = f"{prefix}{key}_{schedule}_M{mm}"
                    if name in r:
                        shown = f"{prefix}schedule_bubble_{schedule}_M{mm}" if key == "bubble" else name
                        line(shown, r[name] * (1e3 if unit == "ms" else 1), unit)
        if not prefix:
            for mm in MICROBATCHES:
                if f"peak_1f1b_M{mm}" in r:
                    line(f"peak_activation_1f1b_over_gpipe_M{mm}", r[f"peak_1f1b_M{mm}"] / r[f"peak_gpipe_M{mm}"], "x")
                    line(f"peak_activation_theory_M{mm}", K / mm, "x")
        line(f"{prefix}balance_time_over_params", r[f"{prefix}balance_time_over_params"], "x")
        line(f"{prefix}balance_theory_time_over_params", r[f"{prefix}balance_theory"], "x")
        # the slowest stage's compute per step, time / params: what balancing changes
        line(f"{prefix}balance_busiest_stage_time_over_params", r[f"{prefix}balance_busiest"], "x")
        print(
            f"# {prefix or 'sim '}blocks per stage: params {r[f'{prefix}balance_split_params']}, "
            f"time {r[f'{prefix}balance_split_time']}",
            flush=True,
        )
    line("pipeline_step_over_unsplit", r["lightning_ratio"], "x")
    line("pipeline_step_theory_over_unsplit", (m + K - 1) / (m * K), "x")
    line("pipeline_step_ms", r["lightning_pipe_ms"], "ms")
    line("unsplit_step_ms", r["lightning_single_ms"], "ms")
    print(f"# Lightning fits: 1F1B, M={m}, simulated 4-block model, {steps} steps x {args.rounds} rounds", flush=True)
    # what the overhead is made of: one transfer's latency; the real blocks' compute and how far
    # the machine runs two compute-bound processes at once (1.0: two free cores)
    line("p2p_one_way_ms", r["p2p_ms"], "ms")
    line("real_compute_ms_per_microbatch_stage", r["real_compute_ms"], "ms")
    line("real_cpu_parallel_efficiency", r["real_parallel_efficiency"], "x")
    if not args.quick:
        plot_bubble(r, Path(__file__).parent / "results" / "pipeline.png", stage_ms=3 * 2 * args.sim_ms)
    print(load_line("end"), flush=True)
    return 0


def plot_bubble(r: dict[str, Any], path: Path, *, stage_ms: float) -> None:
    """The seed's claim 5: bubble, bubble / theory and step time against M."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax, ax_r, ax_t) = plt.subplots(1, 3, figsize=(15, 3.8))
    spans: list[float] = []
    for schedule, marker, color in (("gpipe", "o", "tab:blue"), ("1f1b", "s", "tab:orange")):
        ms = [m for m in MICROBATCHES if f"bubble_{schedule}_M{m}" in r]
        theory = [(K - 1) / (m + K - 1) for m in ms]
        for key, style, alpha, label in (
            ("idle", "-", 1.0, "measured (sim)"),
            ("real_idle", "--", 0.5, "measured (real compute)"),
        ):
            ax.plot(ms, [r[f"{key}_{schedule}_M{m}"] for m in ms], marker + style, color=color, alpha=alpha,
                    label=f"{schedule} {label}")  # fmt: skip
        for key, style, alpha, label in (
            ("idle", "-", 1.0, "measured (sim)"),
            ("floor_idle", "-.", 0.7, "bare gloo loop, equal stages (floor)"),
            ("bubble", ":", 0.7, "schedule fill/drain alone (replay)"),
        ):
            if all(f"{key}_{schedule}_M{m}" in r for m in ms):
                ratios = [r[f"{key}_{schedule}_M{m}"] / t for m, t in zip(ms, theory, strict=True)]
                ax_r.plot(ms, ratios, marker + style, color=color, alpha=alpha, label=f"{schedule} {label}")
        spans = [*spans, *(1e3 * r[f"span_{schedule}_M{m}"] for m in ms)]
        ax_t.plot(ms, spans[-len(ms) :], marker + "-", color=color, label=f"{schedule} (sim)")
    ax.plot(MICROBATCHES, [(K - 1) / (m + K - 1) for m in MICROBATCHES], "k--", label="(K-1)/(M+K-1)")
    ax_r.axhline(1.15, color="k", linestyle="--", linewidth=1, label="goal 1.15")
    ax_r.axhline(1.0, color="grey", linewidth=0.8)
    ax_t.plot(MICROBATCHES, [(m + K - 1) * stage_ms for m in MICROBATCHES], "k--", label="(M+K-1) x nominal (F+B)")
    for a in (ax, ax_r, ax_t):
        a.set_xscale("log", base=2)
        a.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
        a.set_xlabel("micro-batches M")
        a.legend(fontsize=7)
    ax.set_ylabel("idle share of a step")
    ax.set_title(f"pipeline bubble, K={K}", fontsize=9)
    ax_r.set_ylabel("bubble / (K-1)/(M+K-1)")
    ax_r.set_title("bubble over theory: runtime, transport floor, schedule alone", fontsize=9)
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_yscale("log")
    ax_t.set_yticks([t for t in (50, 100, 200, 500, 1000, 2000, 5000, 10000) if t <= 2 * max(spans)])
    ax_t.yaxis.set_major_formatter(ScalarFormatter())
    ax_t.yaxis.set_minor_formatter(NullFormatter())
    ax_t.set_title(f"step time, simulated stages of {stage_ms:g} ms per micro-batch (F+B)", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
