"""A probe of the CPU a run gets: the emulated cluster's MLP step, timed alone and on P processes at once.

Kept alive between probes (``with ComputeProbe(P) as probe: alone, together = probe()``): P spawned
processes, one torch thread each, time the forward + backward of ``benchmarks/emulated/_fit.py``'s
MLP at batch 32, one of them alone (the median of ``reps`` steps) and then all P at once behind a barrier
(each one's ``reps`` steps' wall time over their number: waits for a core included).
``alone`` is what a process's compute takes at this moment (other jobs on the machine included);
``P x alone / together`` the cores P processes share (``_scale_costs.effective_cores``).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import time
from typing import Any

__all__ = ["ComputeProbe", "mlp_step_s"]

IN, OUT = 256, 16  # benchmarks/emulated/_fit.py's


def mlp_step_s(reps: int = 9, *, width: int = 1024, layers: int = 2, batch: int = 32, whole: bool = False) -> float:
    """Median seconds of the MLP's forward + backward at ``batch`` (two untimed first); ``whole``: the timed
    steps' wall time over their number instead, the time the process spent waiting for a core included."""
    import torch  # only torch: a spawned probe process starts in seconds, not Lightning's tens of seconds
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dims = [IN, *[width] * layers, OUT]  # _fit.MLP's layers
    mods: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        mods += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*mods[:-1])
    x, y = torch.randn(batch, IN), torch.randn(batch, OUT)
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
        if i == 1:
            begin = time.perf_counter()
    return (time.perf_counter() - begin) / reps if whole else statistics.median(times)


def _worker(conn: Any, barrier: Any, reps: int) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        if job == "together":
            barrier.wait()
        # together: the whole run's time per step. P processes on fewer cores take turns in time slices of
        # several steps, so most single steps run at full speed and their median hid the sharing (P x alone /
        # together gave up to 6.9 cores on this 2-core machine in the advisor_cluster runs stored before
        # 2026-12-04, in git history)
        conn.send(mlp_step_s(reps, whole=job == "together"))


class ComputeProbe:
    """``probe()`` -> (alone_s, together_s) of the MLP step on ``world`` processes."""

    def __init__(self, world: int, reps: int = 31) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process whose torch threads already run
        self.world = world
        self._barrier = ctx.Barrier(world)
        self._pipes = []
        self._procs = []
        for _ in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(theirs, self._barrier, reps), daemon=True)
            proc.start()
            self._pipes.append(mine)
            self._procs.append(proc)
        self()  # one probe untimed: the first after the spawn can find P processes as fast as one alone

    def __call__(self) -> tuple[float, float]:
        self._pipes[0].send("alone")
        alone = float(self._pipes[0].recv())
        for pipe in self._pipes:
            pipe.send("together")
        together = statistics.median(float(pipe.recv()) for pipe in self._pipes)
        return alone, together

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.send(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> ComputeProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
