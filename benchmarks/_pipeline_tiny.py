"""What every torchrun worker of ``benchmarks/pipeline_cpu.py``'s bare runs does: the pipeline runtime alone.

    torchrun --standalone --nproc-per-node 2 benchmarks/_pipeline_tiny.py --width 8 --out /tmp/t.json

A 2-stage :class:`~lightning_strategies.comm.pipeline.PipelineRuntime` (blocks of Linear + tanh, 2 per stage,
``--width`` wide; 8: no compute to speak of) steps ``--steps`` times under each schedule, M = 8 micro-batches of
8 rows, no Lightning and no strategy around it. Each rank writes, per schedule, its main thread's CPU seconds
(``time.thread_time``) and wall seconds per step, medians over the steps after 3 untimed ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._pipeline_models import loss, real_balanced
from lightning_strategies.comm.pipeline import SCHEDULES, PipelineRuntime

MICROBATCHES, ROWS = 8, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    assert world is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICROBATCHES * ROWS, args.width, generator=g)
    y = torch.randn(MICROBATCHES * ROWS, args.width, generator=g)
    out: dict[str, dict[str, float]] = {}
    for schedule in ("gpipe", "1f1b"):
        assert schedule in SCHEDULES
        runtime = PipelineRuntime(
            real_balanced(args.width, 4), counts=[2, 2], schedule=schedule, microbatches=MICROBATCHES, loss_fn=loss,
            group=world, device=torch.device("cpu"),
        )  # fmt: skip
        cpu, wall = [], []
        for i in range(args.steps + 3):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            runtime.step(x, y)
            c1, t1 = time.thread_time(), time.perf_counter()
            for p in runtime.stage_parameters:
                p.grad = None
            if i >= 3:
                cpu.append(c1 - c0)
                wall.append(t1 - t0)
        out[schedule] = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
