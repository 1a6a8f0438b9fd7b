"""What ``pipeline_cpu.py`` and ``tensor_cpu.py`` share: a fit of ``emulated/_fit.py`` on loopback under
``torchrun --standalone`` and each rank's CPU per timed step, read from its record (``/proc`` clock ticks
of its threads, the main thread's ``time.thread_time`` at each step phase)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import load_line, median
from lightning_strategies.advisor import Cluster, load_cluster

FIT = Path(__file__).resolve().parent / "emulated" / "_fit.py"
RESULTS = Path(__file__).resolve().parent / "results"
PRESET = "emulated_2x2_1gbit"  # its host figures (wake-ups for up to 4 processes, overheads, cores)


def torchrun(script: Path, nproc: int, args: Sequence[str], what: str, timeout: float, **env: str) -> None:
    """``torchrun --standalone`` of ``script`` on ``nproc`` processes (one torch thread each), from a temporary
    directory; raises with the tail of its stderr when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
            *args]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rank-cpu-") as tmp:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: exit {proc.returncode}\n{proc.stderr[-3000:]}")


def run_fit(strategy: str, world: int, steps: int, warmup: int, timeout: float) -> list[dict]:
    """One fit of ``_fit.py``'s MLP under ``strategy`` on ``world`` loopback processes: every rank's record."""
    with tempfile.TemporaryDirectory(prefix=f"{strategy}-cpu-") as tmp:
        out = Path(tmp) / "out"
        args = ["--strategy", strategy, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        torchrun(FIT, world, args, f"{strategy} fit on {world} processes", timeout, GLOO_SOCKET_IFNAME="lo")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def wall_per_step(records: Sequence[dict]) -> float:
    """The timed window's wall seconds over its steps (rank 0's record)."""
    return float(records[0]["window"]["wall"] / records[0]["window"]["steps"])


def split_cpu(record: dict) -> tuple[float, float, float]:
    """(main thread, gloo's threads, every thread) CPU seconds per timed step of one rank's record."""
    steps = record["window"]["steps"]
    threads: dict[str, float] = record["thread_cpu_s"]
    gloo = sum(v for k, v in threads.items() if k.startswith(("gloo", "pt_gloo")))
    main = max(v for k, v in threads.items() if not k.startswith(("gloo", "pt_gloo")))
    return main / steps, gloo / steps, sum(threads.values()) / steps


def phase_cpu(record: dict) -> tuple[float, float]:
    """(the training step's, the rest's) main-thread CPU seconds of one rank, medians over its timed steps: the
    training step runs to the backward (a pipeline's whole schedule: its chunks, transfers' Python, the outputs'
    broadcast; elsewhere the forward); the rest runs from the backward hook to the next step's start (the
    backward where it is not in the training step, the optimizer step, Lightning's loop and the data)."""
    phases = record["phases"][record["warmup"] :]
    step = [p["cpu_backward"] - p["cpu_start"] for p in phases]
    rest = [b["cpu_start"] - a["cpu_backward"] for a, b in itertools.pairwise(phases)]
    return median(step), median(rest)


def loopback(world: int) -> Cluster:
    """The 2x2 preset's host figures on one node of ``world`` processes (loopback)."""
    return dataclasses.replace(load_cluster(PRESET), nodes=1, per_node=world, name=f"loopback_{world}")


def finish(text: list[str], name: str, quick: bool) -> int:
    """The load at the end, then ``results/<name>.txt`` unless ``quick``; the script's exit status."""
    text.append(load_line("end"))
    if not quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.txt").write_text("\n".join(text) + "\n")
    return 0


def parse_fit_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *, steps: int) -> argparse.Namespace:
    """``parser``'s arguments with the loopback fits' own: ``--worlds`` (2 4), ``--rounds`` (2), ``--steps``,
    ``--warmup`` (5) and ``--quick`` (P = 2, 1 round, 8 steps of which 3 untimed; writes nothing)."""
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="P = 2, 1 round, 8 steps; writes nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.rounds, args.steps, args.warmup = [2], 1, 8, 3
    return args
