"""What every torchrun worker of ``advisor_cluster.py``'s message probe runs: one small message's latency, now.

    python -m benchmarks.emulated --nodes 2 --per-node 2 --rate 1gbit -- \\
        python benchmarks/emulated/_latency.py --out /tmp/x.json

The calibration's tiny messages (``benchmarks/_scale_measure.py``: ``gloo_tiny_allreduce_s`` and ``rpc_small_s``),
taken the same way inside the emulated cluster: a pair of ranks times them while every other rank waits in a
barrier, ``--reps`` times after one untimed round (the pair's connections made), each repetition 4 calls:

    gloo_intra   ranks 0 and 1 (one node; with 2 or more per node): an all-reduce of one float, 2 messages
    gloo_inter   ranks 0 and L (nodes 0 and 1, L per node): the same between nodes
    rpc_intra    rank 1 calls rank 0 (TensorPipe, as ``comm.rpc.init_rpc`` sets it up) with 4 KiB that come
                 back: a round trip
    rpc_inter    rank L calls rank 0 the same way
    gloo_inter_busy  gloo_inter while every other rank computes (a matmul loop for ``BUSY_S``, from the same
                 barrier): the P processes of a fit on the machine's cores, as the calibration's ``wake_<b>_s``

Global rank 0 writes ``{pattern: seconds}`` to ``--out``: per message for gloo (the median repetition / 4 / 2),
per round trip for RPC (/ 4), the calibration's units. A message's latency on this machine is mostly its
host's part: the library's software and the receiver's wake-up, which wait for a core behind whatever else
is runnable, so it moves with the other jobs' load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.emulated._rpc_world import gloo_and_rpc
from lightning_strategies.comm.rpc import worker_name

CALLS = 4  # per repetition, as the calibration's
RPC_BYTES = 4096  # _scale_costs.CALIB_SMALL: the calibration's bare round trip
BUSY_S = 0.03  # the others' compute per repetition: longer than the pair's 4 calls (~1-3 ms; 10 ms at worst seen)


def _echo(payload: torch.Tensor) -> torch.Tensor:
    return payload


def spin(seconds: float) -> None:
    """Compute (small matmuls, one thread) for ``seconds`` of wall time."""
    a = torch.ones(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).clamp_(max=1.0)


def timed(fn: Callable[[], None], timing: bool, reps: int, busy: bool = False) -> float:
    """The median seconds of ``fn`` on the ranks that time (``timing``), every rank in a barrier around each; the
    others wait in the barrier, or compute for ``BUSY_S`` with ``busy``."""
    times = []
    for rep in range(reps + 1):
        dist.barrier()
        if timing:
            t0 = time.perf_counter()
            fn()
            if rep:  # the first: connections made
                times.append(time.perf_counter() - t0)
        elif busy:
            spin(BUSY_S)
        dist.barrier()
    return statistics.median(times) if times else 0.0


def measure(rank: int, world: int, local: int, reps: int) -> dict[str, float]:
    """Every figure of the module's docstring, on every rank (nodes of ``local`` consecutive ranks)."""
    from torch.distributed import rpc

    pairs = {"intra": (0, 1), "inter": (0, local)} if local > 1 else {"inter": (0, local)}
    # every rank makes every group
    groups: dict[str, Any] = {name: dist.new_group(list(pair)) for name, pair in pairs.items()}
    tiny, payload = torch.zeros(1), torch.ones(RPC_BYTES // 4)
    out: dict[str, float] = {}
    for name, (a, b) in pairs.items():

        def allreduce(group: Any = groups[name]) -> None:
            for _ in range(CALLS):
                dist.all_reduce(tiny, group=group)

        def call(to: str = worker_name(a)) -> None:
            for _ in range(CALLS):
                rpc.rpc_sync(to, _echo, args=(payload,))

        out[f"gloo_{name}"] = timed(allreduce, rank in (a, b), reps) / CALLS / 2
        out[f"rpc_{name}"] = timed(call, rank == b, reps) / CALLS

    def inter_allreduce() -> None:
        for _ in range(CALLS):
            dist.all_reduce(tiny, group=groups["inter"])

    out["gloo_inter_busy"] = timed(inter_allreduce, rank in pairs["inter"], reps, busy=True) / CALLS / 2
    # rank 0 times the gloo pairs, rank b the RPC calls: every figure to rank 0
    gathered: list[dict[str, float] | None] = [None] * world
    dist.all_gather_object(gathered, out)
    return {k: max((g or {}).get(k, 0.0) for g in gathered) for k in out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % local or world // local < 2:
        raise RuntimeError(f"found {world} ranks in nodes of {local}: expected 2 or more nodes of equal size")
    with gloo_and_rpc(timedelta(seconds=60)) as (rank, world):
        figures = measure(rank, world, local, args.reps)
        if rank == 0:
            args.out.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
