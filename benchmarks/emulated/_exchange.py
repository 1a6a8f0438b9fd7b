"""What every torchrun worker of ``benchmarks/cluster_exchange.py`` runs: the transports under ddp and ps, bare.

    python -m benchmarks.emulated --nodes 4 --per-node 1 --rate 50mbit -- \\
        python benchmarks/emulated/_exchange.py --out /tmp/x.json

With D bytes of fp32 (``--mbytes``, default the cluster benchmark's MLP: 5,316,672 B) and P processes, each
pattern is timed ``--reps`` times, between two barriers, after one untimed run:

    allreduce    gloo's all-reduce of D (ddp's transport: 2(P-1)/P x D each way per process)
    push         every process sends D/P to every other at once over the library's RPC (TensorPipe, as
                 ``comm.rpc.init_rpc`` sets it up); the reply is one float: one direction of ps's exchange
    two_phase    push, a barrier (a shard answers once every push is in), then every process pulls D/P from
                 every other at once: ps's exchange, the same bytes as the all-reduce
    echo         every process sends D/P to every other, each reply carrying D/P back at once (no barrier)
    rs_ag        gloo's reduce-scatter of D, then its all-gather of D/P: a ps exchange run as collectives
                 (shard s's sum lands on rank s, then every shard's values on every rank)
    a2a          gloo's all-to-all of D (D/P to every peer), then of D/P back: the two phases' pattern,
                 every flow at once, on gloo's transport instead of TensorPipe's
    hier_push    what crosses the links in ps's hierarchical push (N nodes of L): local rank j sends D/P to
                 local rank j of every other node at once, a barrier, then pulls D/P back from each: one flow
                 per local rank and remote node each way, 2(N-1)/N x D each way through a node's link (the
                 node's own collectives, on loopback, left out)

Global rank 0 writes ``{pattern: [seconds, ...]}`` to ``--out``, and per pattern ``<pattern>:kernel_cpu`` and
``<pattern>:user_cpu``: the whole machine's CPU seconds in the kernel (system, irq, softirq: the emulated links'
veth pairs, bridge and HTB queues among them) and in user space during each repetition (``/proc/stat``, 10 ms
ticks; every process on the machine counts, other jobs' too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.emulated._rpc_world import gloo_and_rpc
from lightning_strategies.comm.rpc import worker_name

D_BYTES = 5_316_672  # the MLP of benchmarks/emulated/_fit.py: 1,329,168 fp32 parameters
PATTERNS = ("allreduce", "push", "two_phase", "echo", "rs_ag", "a2a", "hier_push")
_CHUNK: list[torch.Tensor] = []


def _ack(chunk: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1)


def _echo(chunk: torch.Tensor) -> torch.Tensor:
    return chunk


def _values(numel: int) -> torch.Tensor:
    return _CHUNK[0] if _CHUNK and _CHUNK[0].numel() == numel else torch.ones(numel)


def machine_cpu() -> tuple[float, float]:
    """(kernel, user) CPU seconds of the whole machine so far: ``/proc/stat``'s first line (not per namespace)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (system + irq + softirq) / tick, (user + nice) / tick


def measure(rank: int, world: int, nbytes: int, reps: int) -> dict[str, list[float]]:
    """Every pattern's seconds per repetition and the machine's kernel and user CPU during it, on every rank."""
    from torch.distributed import rpc

    numel = nbytes // 4
    chunk = numel // world
    _CHUNK.append(torch.ones(chunk))
    full = torch.ones(numel)
    peers = [worker_name(j) for j in range(world) if j != rank]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % local or int(os.environ.get("LOCAL_RANK", "0")) != rank % local:
        raise RuntimeError(f"rank {rank}: expected nodes of {local} consecutive ranks (torchrun's static rendezvous)")
    node, j = divmod(rank, local)
    remote = [worker_name(n * local + j) for n in range(world // local) if n != node]  # this local rank's shards

    def allreduce() -> None:
        dist.all_reduce(full)

    def push(to: tuple[str, ...] = tuple(peers)) -> None:
        for f in [rpc.rpc_async(p, _ack, args=(_CHUNK[0],)) for p in to]:
            f.wait()

    def two_phase(to: tuple[str, ...] = tuple(peers)) -> None:  # push, a barrier (every push is in), pull
        push(to)
        dist.barrier()
        for f in [rpc.rpc_async(p, _values, args=(chunk,)) for p in to]:
            f.wait()

    def hier_push() -> None:  # two_phase between this local rank and its counterparts on the other nodes
        two_phase(tuple(remote))

    def echo() -> None:
        for f in [rpc.rpc_async(p, _echo, args=(_CHUNK[0],)) for p in peers]:
            f.wait()

    shard = torch.ones(chunk)
    whole = torch.ones(chunk * world)

    def rs_ag() -> None:
        dist.reduce_scatter_tensor(shard, whole)
        dist.all_gather_into_tensor(whole, shard)

    def a2a() -> None:
        received = torch.empty_like(whole)
        dist.all_to_all_single(received, whole)
        dist.all_to_all_single(whole, received)

    fns: dict[str, Callable[[], None]] = {
        "allreduce": allreduce, "push": push, "two_phase": two_phase, "echo": echo, "rs_ag": rs_ag, "a2a": a2a,
        "hier_push": hier_push,
    }  # fmt: skip
    times: dict[str, list[float]] = {key: [] for name in PATTERNS for key in (name, f"{name}:kernel_cpu",
                                                                               f"{name}:user_cpu")}  # fmt: skip
    for rep in range(reps + 1):
        order = PATTERNS[rep % len(PATTERNS) :] + PATTERNS[: rep % len(PATTERNS)]  # interleaved, rotated
        for name in order:
            dist.barrier()
            kernel, user = machine_cpu()
            t0 = time.perf_counter()
            fns[name]()
            dist.barrier()
            if rep > 0:  # the first repetition warms connections up
                times[name].append(time.perf_counter() - t0)
                k1, u1 = machine_cpu()
                times[f"{name}:kernel_cpu"].append(k1 - kernel)
                times[f"{name}:user_cpu"].append(u1 - user)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=D_BYTES, help="D, fp32 bytes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with gloo_and_rpc(timedelta(seconds=120)) as (rank, world):
        times = measure(rank, world, args.bytes, args.reps)
        if rank == 0:
            args.out.write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
