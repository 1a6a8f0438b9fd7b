"""Where a pipeline step's time goes on this machine: each rank's CPU against the advisor's work (#30).

The advisor's pipeline cells were its worst (0.48-0.63 under-predicted at 1gbit, where the link costs
next to nothing, before a micro-batch's compute was timed rather than scaled). This runs the same fit on
loopback, no link at all: the
emulated cluster's MLP under ``PipelineStrategy`` at K = P stages, M = 4K micro-batches, 1F1B, batch
32 x P (``benchmarks/emulated/_fit.py``, as ``advisor_cluster.py`` runs it) under ``torchrun
--standalone``, and reads what each rank's threads spent (``/proc``, over the timed steps) next to
what the model charges each stage: its micro-batches' compute measured here (``advisor.measure``,
the ``stage_seconds`` of :func:`~lightning_strategies.advisor.advise.strategy_workload`) and the
preset's ``chunk_overhead_us`` per chunk (2M chunks). Lines, per world P and rank r (medians over
rounds):

    pipeline_cpu_wall_s_per_step_P<P>                 the timed window's wall time over its steps
    pipeline_cpu_predicted_step_s_P<P>                the advisor's step (the 2x2 preset's host figures,
                                                      on one node of P processes)
    pipeline_cpu_predicted_over_wall_P<P>
    pipeline_cpu_main_s_per_step_P<P>_rank<r>         the main thread's CPU per step (chunks, the
                                                      schedule's Python, Lightning)
    pipeline_cpu_gloo_s_per_step_P<P>_rank<r>         gloo's threads' CPU per step (the transfers)
    pipeline_cpu_main_training_step_s_P<P>_rank<r>    of the main thread's: the training step (the whole
                                                      schedule: chunks, transfers' Python, the broadcast)
    pipeline_cpu_main_rest_s_P<P>_rank<r>             the rest (backward hook to the next step: gradients'
                                                      hand-off, optimizer step, Lightning's loop, data);
                                                      both per step, medians, from ``time.thread_time``
    pipeline_cpu_model_work_s_per_step_P<P>_rank<r>   what the model charges rank r's stage per step
    pipeline_cpu_main_over_model_P<P>_rank<r>         main thread's CPU over the model's work
    pipeline_cpu_fit_beyond_compute_us_per_chunk_P<P>_rank<r>   the training step's main-thread CPU beyond the
                                                      stage's compute measured alone, per chunk (2M): the
                                                      runtime's and the strategy's work per chunk in the fit,
                                                      and whatever the compute itself costs more there
    pipeline_cpu_bare_us_per_chunk_w<W>_<schedule>_rank<r>   the runtime alone (``_pipeline_tiny.py``: 2
                                                      stages of 2 blocks W wide, M = 8 of 8 rows, no Lightning):
                                                      main-thread CPU per chunk; W = 8 is the runtime's own work
    pipeline_cpu_bare_wall_s_w<W>_<schedule>          its wall time per step (the slower rank)
    pipeline_cpu_all_over_cores_P<P>                  every thread's CPU of every rank over (cores x wall):
                                                      near 1, the step is CPU-bound on this machine

CPU seconds come from ``/proc`` in clock ticks (10 ms): over 40 timed steps a line is good to 0.25 ms.

    python benchmarks/pipeline_cpu.py              # P = 2 and 4, 2 rounds (~2 min); writes results/pipeline_cpu.txt
    python benchmarks/pipeline_cpu.py --quick      # P = 2, 1 round, 8 steps, bare 8 wide; writes nothing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_average, load_line, median
from benchmarks._rank_cpu import (
    PRESET,
    finish,
    loopback,
    parse_fit_args,
    phase_cpu,
    run_fit,
    split_cpu,
    torchrun,
    wall_per_step,
)
from benchmarks.emulated._fit import IN, MLP, OUT
from lightning_strategies.advisor import measure
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.measure import Measurement
from lightning_strategies.advisor.model import predict

TINY = Path(__file__).resolve().parent / "_pipeline_tiny.py"
TINY_CHUNKS = 16  # _pipeline_tiny.py: M = 8 micro-batches, a forward and a backward chunk each


def bare_runtime(width: int, steps: int, timeout: float) -> list[dict[str, dict[str, float]]]:
    """``_pipeline_tiny.py`` on 2 processes: per rank, per schedule, the bare runtime's CPU and wall per step."""
    with tempfile.TemporaryDirectory(prefix="pipeline-tiny-") as tmp:
        out = Path(tmp) / "tiny.json"
        torchrun(TINY, 2, ["--width", str(width), "--steps", str(steps), "--out", str(out)], "bare pipeline runtime",
                  timeout)  # fmt: skip
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def model_work(m: Measurement, world: int) -> tuple[list[float], list[float], float]:
    """Per rank, the seconds of work the advisor charges its stage per step and of that its compute; and the
    predicted step, for the MLP measured as ``m``."""
    costs = loopback(world).costs(m.step_s)
    work = strategy_workload(m, "pipeline", 32, num_stages=world, microbatches=4 * world)
    stages = work.stage_seconds or ()
    per_rank = [work.microbatches * s + 2 * work.microbatches * costs.chunk_overhead_s for s in stages]
    return per_rank, [work.microbatches * s for s in stages], predict("pipeline", costs, world, work).step_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--no-bare", dest="bare", action="store_false", help="skip the bare runtime's runs")
    args = parse_fit_args(parser, argv, steps=45)  # --quick: the bare runtime 8 wide, 5 steps
    text = [header("pipeline_cpu: each pipeline rank's CPU per step against the advisor's work, on loopback")]
    text.append(load_line("start"))
    text.append(f"# fit: _fit.py MLP, K = P stages, M = 4K, 1F1B, batch 32 x P; {args.steps} steps, "
                f"{args.warmup} untimed; model: preset {PRESET} on 1 node of P; {args.rounds} round(s)")  # fmt: skip
    print("\n".join(text), flush=True)
    rows: dict[int, list[list[dict]]] = {w: [] for w in args.worlds}
    for r in range(args.rounds):
        for world in args.worlds if r % 2 == 0 else reversed(args.worlds):  # interleaved
            rows[world].append(run_fit("pipeline", world, args.steps, args.warmup, timeout=600.0))
            wall = wall_per_step(rows[world][-1])
            text.append(f"# round {r} P={world}: {1e3 * wall:.1f} ms wall/step (load {load_average()})")
            print(text[-1], flush=True)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1)  # after the fits: as every rank of them, one thread
    m = measure(MLP(1024, 2), (torch.randn(32, IN), torch.randn(32, OUT)), repeats=5)
    for world in args.worlds:
        work, compute, predicted = model_work(m, world)
        chunks = 2 * 4 * world
        walls = [median([rec["window"]["wall"] / rec["window"]["steps"] for rec in run]) for run in rows[world]]
        wall = median(walls)
        text.append(line(f"pipeline_cpu_wall_s_per_step_P{world}", wall, "s"))
        text.append(line(f"pipeline_cpu_predicted_step_s_P{world}", predicted, "s"))
        text.append(line(f"pipeline_cpu_predicted_over_wall_P{world}", predicted / wall, "x"))
        every = []
        for rank in range(world):
            cpu = [split_cpu(run[rank]) for run in rows[world]]
            main_s, gloo_s = median([c[0] for c in cpu]), median([c[1] for c in cpu])
            every.append(median([c[2] for c in cpu]))
            text.append(line(f"pipeline_cpu_main_s_per_step_P{world}_rank{rank}", main_s, "cpu_s"))
            text.append(line(f"pipeline_cpu_gloo_s_per_step_P{world}_rank{rank}", gloo_s, "cpu_s"))
            step_s, rest_s = (median(v) for v in zip(*(phase_cpu(run[rank]) for run in rows[world]), strict=True))
            text.append(line(f"pipeline_cpu_main_training_step_s_P{world}_rank{rank}", step_s, "cpu_s"))
            text.append(line(f"pipeline_cpu_main_rest_s_P{world}_rank{rank}", rest_s, "cpu_s"))
            text.append(line(f"pipeline_cpu_model_work_s_per_step_P{world}_rank{rank}", work[rank], "s"))
            beyond = (step_s - compute[rank]) / chunks
            text.append(line(f"pipeline_cpu_fit_beyond_compute_us_per_chunk_P{world}_rank{rank}", 1e6 * beyond, "us"))
            text.append(line(f"pipeline_cpu_main_over_model_P{world}_rank{rank}", main_s / work[rank], "x"))
        text.append(line(f"pipeline_cpu_all_over_cores_P{world}", sum(every) / (min(cores, world) * wall), "x"))
    if args.bare:
        for width in (8,) if args.quick else (8, 1024):
            ranks = bare_runtime(width, 5 if args.quick else 40, timeout=300.0)
            for schedule in ranks[0]:
                for rank, got in enumerate(ranks):
                    per_chunk = 1e6 * got[schedule]["cpu_s"] / TINY_CHUNKS
                    text.append(line(f"pipeline_cpu_bare_us_per_chunk_w{width}_{schedule}_rank{rank}", per_chunk, "us"))
                wall = max(got[schedule]["wall_s"] for got in ranks)
                text.append(line(f"pipeline_cpu_bare_wall_s_w{width}_{schedule}", wall, "s"))
    return finish(text, "pipeline_cpu", args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
