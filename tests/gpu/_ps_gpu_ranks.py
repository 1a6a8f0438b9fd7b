"""The ranks of ``test_ps_gpu.py``'s two-process runs on one GPU (a module of its own: spawned
processes import their function by name), and the gradients both the ranks and the CPU reference use.

Each rank's gradients are produced late on its own (default) stream: ``torch.cuda._sleep`` keeps
the stream busy first, so a shard that read them without waiting for the pusher's stream, or a
step that ran concurrently with another on a second stream, would compute on stale memory.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_strategies.comm.async_ps import AsyncParameterServerClient, AsyncParameterShard
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    partition_parameters,
    register_shard,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc, worker_name

SIZES = (1 << 18, 4096, 1 << 16, 8)  # big enough that kernels take time, cuts inside tensors
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time before each rank's gradients are written


def initial_params(device: torch.device | str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g).to(device).requires_grad_(True) for n in SIZES]


def grad(rank: int, step: int, i: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of tensor ``i`` at ``step`` (CPU, deterministic)."""
    return torch.randn(SIZES[i], generator=torch.Generator().manual_seed(1000 * rank + 10 * step + i))


def late_grads(rank: int, step: int, device: torch.device) -> list[torch.Tensor]:
    """This step's gradients on ``device``, written after the current stream has been kept busy."""
    staged = [grad(rank, step, i).to(device) for i in range(len(SIZES))]
    torch.cuda._sleep(SLEEP_CYCLES)
    return [s.mul(1.0) for s in staged]  # enqueued behind the sleep on this rank's stream


def train(rank: int, world: int, mode: str, steps: int, lr: float) -> list[Any]:
    """``steps`` pushes of this rank to ``world`` shards on cuda:0 (``mode``: "sync" or "async");
    the final weights as numpy arrays."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    timeout = timedelta(seconds=60)
    store = rendezvous_store(rank, world, "127.0.0.1", timeout=timeout)
    # every rank on the one GPU: TensorPipe moves CUDA tensors directly, cuda:0 -> cuda:0
    maps = {worker_name(r): {device: device} for r in range(world) if r != rank}
    init_rpc(rank, world, store, timeout=timeout, num_threads=4, device_maps=maps)
    failed = True
    try:
        params = initial_params(device)
        momentum = 0.9 if mode == "sync" else 0.0
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=lr, momentum=momentum))
        plan = partition_parameters(list(SIZES), world)
        mine = [slice_of(params[sl.tensor], sl) for sl in plan[rank]]
        shard_cls = ParameterShard if mode == "sync" else AsyncParameterShard
        register_shard(shard_cls(rank, plan[rank], mine, spec, world, timeout=timeout))
        dist.barrier()
        client: ParameterServerClient
        if mode == "sync":
            client = ParameterServerClient(rank, params, plan, timeout=timeout)
            for step in range(steps):
                for p, g in zip(params, late_grads(rank, step, device), strict=True):
                    p.grad = g
                client.push_pull([lr])
        else:
            client = AsyncParameterServerClient(rank, params, plan, timeout=timeout)
            for step in range(steps):
                client.push(late_grads(rank, step, device), [lr], pull=True)
            dist.barrier()  # every push is applied
            client.pull()
        out = [p.detach().cpu().numpy().copy() for p in params]
        dist.barrier()  # no shard leaves before every rank has pulled
        failed = False
        return out
    finally:
        unregister_shard(rank)
        shutdown_rpc(failed=failed, timeout=timeout)
