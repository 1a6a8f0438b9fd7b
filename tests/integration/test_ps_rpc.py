"""The parameter-server layer over real TensorPipe RPC between fork-started processes:
parity with single-device SGD, and a dying worker making the others fail fast, naming it."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_strategies.comm.heartbeat import failure_reason
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    register_shard,
    shard_parameters,
    unregister_shard,
)
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc
from tests.dist_utils import run_workers

pytestmark = pytest.mark.slow


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (16,), (4, 16), (4,), (8, 8)]
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


def _grad(rank: int, step: int, i: int, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))


def _train(rank: int, world: int, num_servers: int, steps: int, die_at: int | None, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    # RPC meets in a store rank 0 binds on a kernel-picked port, shared over the gloo group
    init_rpc(rank, world, rendezvous_store(rank, world, "127.0.0.1", timeout=timeout), timeout=timeout, num_threads=2)
    failure: str | None = None
    try:
        params = _params()
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        spec = OptimizerSpec.from_optimizer(opt)
        plan = shard_parameters([p.numel() for p in params], num_servers)
        if rank < num_servers:
            register_shard(
                ParameterShard(rank, plan[rank], [params[i] for i in plan[rank]], spec, world, timeout=timeout)
            )
        dist.barrier()
        client = ParameterServerClient(rank, params, plan, timeout=timeout)
        for step in range(steps):
            if step == die_at and rank == 1:
                os._exit(3)  # a crash: no exception handler, no shutdown
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i, p)
            try:
                client.push_pull([0.1])
            except RuntimeError as err:
                # peers are gone: drop the shard with the reason (as the strategy's on_exception
                # does), shut down locally, then let run_workers see it
                failure = failure_reason(err)
                raise
        dist.barrier()
        # numpy, not tensors: a tensor in the result queue is shared by file descriptor, which
        # dies with this process before the parent reads it
        return {"params": [p.detach().numpy().copy() for p in params], "stats": client.stats}
    finally:
        unregister_shard(rank, reason=failure)
        shutdown_rpc(failed=failure is not None, timeout=timeout)


@pytest.mark.parametrize(("world", "num_servers"), [(2, 2), (3, 1), (3, 3)])
def test_rpc_push_pull_equals_single_device_sgd(world: int, num_servers: int) -> None:
    steps = 4
    out = run_workers(_train, world, num_servers, steps, None, 30.0, timeout=90)
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = sum((_grad(r, step, i, p).div(world) for r in range(world)), torch.zeros_like(p))
        opt.step()
    for result in out:
        for got, want in zip(map(torch.from_numpy, result["params"]), params, strict=True):
            # the shard does the reference's operations in the same order: bit-identical
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    n_bytes = sum(p.numel() * 4 for p in params)
    assert all(r["stats"].bytes_sent == r["stats"].bytes_received == steps * n_bytes for r in out)


@pytest.mark.parametrize(
    ("num_servers", "expected"),
    [
        # rank 1 hosts shard 1: the push to it fails as soon as its connection drops; a survivor
        # whose push to shard 0 arrives after rank 0 failed gets rank 0's reason, naming shard 1 too
        (2, r"parameter server shard 1 \(hosted by rank 1"),
        # rank 1 is only a worker: shard 0's barrier times out naming the missing worker
        (1, r"from worker\(s\) \[1\]"),
    ],
)
def test_dead_worker_fails_the_others_within_the_timeout(num_servers: int, expected: str) -> None:
    timeout_s = 4.0
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_workers(_train, 3, num_servers, 5, 2, timeout_s, timeout=60, pg_timeout_s=20)
    # the barrier timeout plus start-up and a non-graceful shutdown, far below run_workers' 60 s
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "--- rank 1 failed:\nprocess exited with code 3" in message
    for survivor in (0, 2):
        section = message.split(f"--- rank {survivor} failed:")[1].split("--- rank")[0]
        assert re.search(expected, section), section
