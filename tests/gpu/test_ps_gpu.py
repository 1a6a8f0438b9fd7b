"""``"ps"`` and ``"async"`` on CUDA against their CPU results: the shards' stream order
(:mod:`lightning_strategies.comm.streams`) with gradients produced late on the pusher's stream,
no host synchronisation in a step, Lightning fits at world size 1, and two ranks on one GPU with
TensorPipe moving CUDA tensors directly. Not run in this project's sessions so far (no GPU); the
CPU side of the same logic is tests/unit/test_ps_streams.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from _ps_gpu_ranks import SIZES, SLEEP_CYCLES, grad, initial_params, train
from gpu_utils import no_host_sync, own_process_group
from torch.utils.data import DataLoader

from benchmarks._workers import run_workers
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
from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
from tests.lightning_utils import GlobalBatchSampler, TinyRegressor, quiet_trainer, regression_data

pytestmark = pytest.mark.gpu

LR = 0.01
# CPU and CUDA kernels add in different orders: ~1 ulp per operation on values of O(1) and a few
# tens of steps stay far below 1e-5; a lost or torn update is off by LR x a gradient (~1e-2)
ATOL = 1e-5


def _sgd_reference(grads_of_step: Any, steps: int, momentum: float) -> list[torch.Tensor]:
    params = initial_params()
    opt = torch.optim.SGD(params, lr=LR, momentum=momentum)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grads_of_step(step, i)
        opt.step()
    return [p.detach() for p in params]


def test_one_worker_step_waits_for_its_late_gradients_and_never_syncs_the_host(cuda: torch.device) -> None:
    steps = 8
    params = initial_params(cuda)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=LR, momentum=0.9))
    plan = partition_parameters(list(SIZES), 1)
    register_shard(ParameterShard(0, plan[0], [slice_of(params[sl.tensor], sl) for sl in plan[0]], spec, 1))
    try:
        client = ParameterServerClient(0, params, plan)
        staged = [[grad(0, s, i).to(cuda) for i in range(len(SIZES))] for s in range(steps)]
        with no_host_sync():  # a push/pull is enqueued work and stream waits only
            for step in range(steps):
                torch.cuda._sleep(SLEEP_CYCLES)  # the gradients below are written late on this stream
                for p, g in zip(params, staged[step], strict=True):
                    p.grad = g.mul(1.0)
                client.push_pull([LR])
        torch.cuda.synchronize()
    finally:
        unregister_shard(0)
    want = _sgd_reference(lambda s, i: grad(0, s, i), steps, 0.9)
    for got, ref in zip(params, want, strict=True):
        torch.testing.assert_close(got.detach().cpu(), ref, rtol=0, atol=ATOL)


def test_one_async_worker_push_and_pull_never_sync_the_host(cuda: torch.device) -> None:
    steps = 8
    params = initial_params(cuda)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=LR))
    plan = partition_parameters(list(SIZES), 1)
    register_shard(AsyncParameterShard(0, plan[0], [slice_of(params[sl.tensor], sl) for sl in plan[0]], spec, 1))
    try:
        client = AsyncParameterServerClient(0, params, plan)
        staged = [[grad(0, s, i).to(cuda) for i in range(len(SIZES))] for s in range(steps)]
        with no_host_sync():  # the shard is local: no RPC, only device work
            for step in range(steps):
                torch.cuda._sleep(SLEEP_CYCLES)
                client.push([g.mul(1.0) for g in staged[step]], [LR], pull=step % 2 == 1)
        torch.cuda.synchronize()
    finally:
        unregister_shard(0)
    want = _sgd_reference(lambda s, i: grad(0, s, i), steps, 0.0)
    for got, ref in zip(params, want, strict=True):  # the last push pulled: the model holds every update
        torch.testing.assert_close(got.detach().cpu(), ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_ranks_on_one_gpu_equal_the_cpu_reference(mode: str) -> None:
    steps = 10
    out = run_workers(train, 2, mode, steps, LR, start_method="spawn", timeout=240.0)
    if mode == "sync":
        # the shards' average and momentum step: single-device SGD on the averaged gradient
        want = _sgd_reference(lambda s, i: (grad(0, s, i) + grad(1, s, i)) / 2, steps, 0.9)
    else:
        # plain SGD: every push is applied once, in whatever order, so the end is p0 - lr x (sum of all
        # pushed gradients) up to rounding (1.4e-6 with the same ranks on CPU); a push applied on stale
        # memory, lost or applied twice is off by LR x a gradient (~1e-2)
        p0 = initial_params()
        want = [(p.detach() - LR * sum(grad(r, s, i) for r in (0, 1) for s in range(steps))) for i, p in enumerate(p0)]
    for rank_result in out:
        for got, ref in zip(rank_result, want, strict=True):
            torch.testing.assert_close(torch.from_numpy(got), ref, rtol=0, atol=ATOL if mode == "sync" else 1e-4)


def _fit(strategy: Any, accelerator: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    model = TinyRegressor()
    data = regression_data()
    loader = DataLoader(data, batch_size=16, sampler=GlobalBatchSampler(len(data), 16))
    trainer = quiet_trainer(strategy, 1, accelerator=accelerator, max_epochs=2, use_distributed_sampler=False, **kwargs)
    with own_process_group():
        trainer.fit(model, loader)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _ps() -> ParameterServerStrategy:
    # "popen" at one process runs in this process (no child: CUDA is initialised here already)
    return ParameterServerStrategy(start_method="popen", timeout=timedelta(seconds=60))


def _async() -> AsyncParameterServerStrategy:
    return AsyncParameterServerStrategy(start_method="popen", timeout=timedelta(seconds=60))


@pytest.mark.parametrize("make", [_ps, _async], ids=["ps", "async"])
def test_fit_on_one_gpu_equals_the_cpu_fit(make: Any, cuda: torch.device) -> None:
    got = _fit(make(), "gpu")
    want = _fit(make(), "cpu")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_ps_mixed_precision_on_one_gpu_equals_a_single_gpu(precision: str, cuda: torch.device) -> None:
    got = _fit(_ps(), "gpu", precision=precision)
    want = _fit("auto", "gpu", precision=precision)
    # one worker: the shard runs the single GPU's optimizer step on the same gradients (the
    # scaler unscales them on the worker, by a power of two): identical, as on CPU
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
