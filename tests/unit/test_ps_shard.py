"""Parameter-server layer in one process: sharding plan, the shard's barrier and optimizer,
state gathering, and the strategy's option checks. No RPC and no process group: a worker's
co-located shard is called directly, so several "workers" can push to one shard here."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_strategies  # noqa: F401  (registers the strategy names)
from benchmarks.ps_traffic import resnet50_sizes
from lightning_strategies.comm.async_ps import AsyncParameterShard, AsyncReply
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    Slice,
    hosted_shard,
    partition_loads,
    partition_parameters,
    register_shard,
    shard_loads,
    shard_parameters,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.rpc import ShardError
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy

# ResNet-50's 161 tensor sizes, grouped: the realistic case for balance
RESNET50_LIKE = (
    [2048 * 1000, 1000]
    + [512 * 2048] * 3
    + [2048 * 512] * 3
    + [512 * 512 * 9] * 3
    + [256 * 1024] * 6
    + [1024 * 256] * 6
    + [256 * 256 * 9] * 6
    + [128 * 512] * 4
    + [512 * 128] * 4
    + [128 * 128 * 9] * 4
    + [64 * 256] * 3
    + [256 * 64] * 3
    + [64 * 64 * 9] * 3
    + [64 * 3 * 49]
    + [64, 128, 256, 512, 1024, 2048] * 18
)


def test_sharding_covers_every_tensor_once_and_is_deterministic() -> None:
    sizes = [7, 300, 5, 300, 12, 0, 64, 64, 1]
    plan = shard_parameters(sizes, 3)
    assert sorted(i for shard in plan for i in shard) == list(range(len(sizes)))
    assert all(shard == sorted(shard) for shard in plan)
    assert plan == shard_parameters(list(sizes), 3)  # same inputs, same plan on every rank
    assert shard_parameters([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties broken by index


@pytest.mark.parametrize("num_servers", [1, 2, 3, 4, 8])
def test_sharding_is_balanced_by_size(num_servers: int) -> None:
    loads = shard_loads(RESNET50_LIKE, shard_parameters(RESNET50_LIKE, num_servers))
    mean = sum(RESNET50_LIKE) / num_servers
    # greedy largest-first never exceeds mean + largest tensor; on ResNet-50 it is within 1 %
    assert max(loads) <= mean + max(RESNET50_LIKE)
    assert max(loads) / mean < 1.01


def test_sharding_with_more_shards_than_tensors_leaves_some_empty() -> None:
    assert shard_parameters([10, 20], 3) == [[1], [0], []]


def test_sharding_rejects_no_servers() -> None:
    with pytest.raises(ValueError, match="num_servers must be >= 1, found 0"):
        shard_parameters([1, 2], 0)


def _elements(plan: list[list[Slice]]) -> list[tuple[int, int]]:
    """(tensor, element) of every element in ``plan``, server by server."""
    return [(sl.tensor, e) for shard in plan for sl in shard for e in range(sl.start, sl.stop)]


@pytest.mark.parametrize("align", [1, 4, 64])
@pytest.mark.parametrize("num_servers", [1, 2, 3, 5, 8, 40])
def test_partition_holds_every_element_on_exactly_one_server(num_servers: int, align: int) -> None:
    sizes = [7, 300, 5, 0, 300, 12, 0, 64, 65, 1, 129]
    plan = partition_parameters(sizes, num_servers, align=align)
    assert len(plan) == num_servers
    every = _elements(plan)
    assert sorted(every) == [(i, e) for i, n in enumerate(sizes) for e in range(n)]  # each once
    assert every == sorted(every)  # contiguous in the flat order, server after server
    zero_size = [sl for shard in plan for sl in shard if sizes[sl.tensor] == 0]
    assert sorted(sl.tensor for sl in zero_size) == [3, 6]  # empty tensors still have an owner
    # cuts inside a tensor fall on multiples of `align` from its start
    for sl in (sl for shard in plan for sl in shard):
        assert sl.start % align == 0 and (sl.stop % align == 0 or sl.stop == sizes[sl.tensor])
    # every server within `align` elements of the mean
    mean = sum(sizes) / num_servers
    assert all(abs(n - mean) <= align for n in partition_loads(plan))
    assert plan == partition_parameters(list(sizes), num_servers, align=align)  # the same on every rank


@pytest.mark.parametrize("num_servers", [8, 64, 256])
def test_partition_balances_resnet50_within_5_percent(num_servers: int) -> None:
    sizes = resnet50_sizes()
    assert len(sizes) == 161 and max(sizes) == 2048 * 512 * 9 // 4  # the 2.36M-element conv
    mean = sum(sizes) / num_servers
    assert max(partition_loads(partition_parameters(sizes, num_servers))) / mean <= 1.05
    # what the whole-tensor plan (kept for LAMB / LARS) cannot do beyond a few servers
    whole = max(shard_loads(sizes, shard_parameters(sizes, num_servers))) / mean
    assert whole < 1.01 if num_servers == 8 else whole > 5


def test_partition_splits_a_tensor_across_servers() -> None:
    assert partition_parameters([128, 16, 64, 4], 3) == [
        [Slice(0, 0, 64)],
        [Slice(0, 64, 128), Slice(1, 0, 16)],
        [Slice(2, 0, 64), Slice(3, 0, 4)],
    ]
    # more servers than elements allow: some are empty
    assert partition_parameters([3], 4, align=1) == [[Slice(0, 0, 1)], [Slice(0, 1, 2)], [], [Slice(0, 2, 3)]]


def test_partition_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_servers must be >= 1, found 0"):
        partition_parameters([1, 2], 0)
    with pytest.raises(ValueError, match="align must be >= 1 element, found 0"):
        partition_parameters([1, 2], 2, align=0)
    with pytest.raises(ValueError, match=r"tensor sizes must be >= 0, found \[-1\]"):
        partition_parameters([1, -1], 2)


def _model_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=g), torch.randn(6, generator=g), torch.randn(3, 6, generator=g)]


def _grad(worker: int, step: int, like: torch.Tensor, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * worker + 10 * step + i)
    return torch.randn(like.shape, generator=g)


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], lr=0.1, momentum=0.9)


def _reference(steps: int, workers: int, lrs: list[float]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Single-device SGD on the gradient averaged the way DDP does (divide, then sum)."""
    params = [p.clone().requires_grad_(True) for p in _model_params()]
    opt = _sgd(params)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for i, p in enumerate(params):
            p.grad = sum((_grad(w, step, p, i).div(workers) for w in range(workers)), torch.zeros_like(p))
        opt.step()
    return [p.detach() for p in params], opt.state_dict()


def _shards(num_servers: int, workers: int, **kw: Any) -> tuple[OptimizerSpec, list[list[int]], list[ParameterShard]]:
    params = _model_params()
    spec = OptimizerSpec.from_optimizer(_sgd([p.clone().requires_grad_(True) for p in params]))
    plan = shard_parameters([p.numel() for p in params], num_servers)
    shards = [ParameterShard(s, idx, [params[i] for i in idx], spec, workers, **kw) for s, idx in enumerate(plan)]
    return spec, plan, shards


def test_sync_shards_equal_single_device_sgd_on_the_averaged_gradient() -> None:
    workers, steps, lrs = 3, 4, [0.1, 0.05, 0.2, 0.1]  # the lr changes: it travels with the push
    _, plan, shards = _shards(2, workers)
    params = _model_params()
    for step in range(steps):
        for shard, idx in zip(shards, plan, strict=True):
            futures = [
                shard.push(w, step, [_grad(w, step, params[i], i) for i in idx], [lrs[step]] * 2)
                for w in range(workers)
            ]
            # the barrier holds every answer until the last worker's push
            replies = [f.wait() for f in futures]
            assert all(r.version == step + 1 for r in replies)
            for i, v in zip(idx, shard.unpack(replies[0].values), strict=True):
                assert v is not None
                params[i] = v.detach().clone()
    expected, _ = _reference(steps, workers, lrs)
    for got, want in zip(params, expected, strict=True):
        # same operations in the same order as the reference: bit-identical
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # byte accounting: each worker's gradients in, each worker's values out
    for shard, idx in zip(shards, plan, strict=True):
        nbytes = sum(params[i].numel() * 4 for i in idx)
        assert shard.stats.bytes_received == shard.stats.bytes_sent == steps * workers * nbytes


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.3}], lr=0.05)


@pytest.mark.parametrize("make_optimizer", [_sgd, _adamw], ids=["sgd_momentum", "adamw"])
@pytest.mark.parametrize("num_servers", [3, 4, 5])
def test_partitioned_shards_equal_a_single_device_optimizer(make_optimizer: Any, num_servers: int) -> None:
    # tensors of 24, 6 and 18 elements cut every 4 elements: slices of one tensor on several
    # shards, each optimized as a parameter of its own, with its tensor's group options
    params = [p.clone().requires_grad_(True) for p in _model_params()]
    spec = OptimizerSpec.from_optimizer(make_optimizer([p.detach().clone().requires_grad_(True) for p in params]))
    assert spec.elementwise
    plan = partition_parameters([p.numel() for p in params], num_servers, align=4)
    assert any(sl.numel < params[sl.tensor].numel() for shard in plan for sl in shard)

    def shards_for(values: list[torch.Tensor]) -> list[ParameterShard]:
        return [
            ParameterShard(s, sls, [slice_of(values[sl.tensor], sl) for sl in sls], spec, 1)
            for s, sls in enumerate(plan)
            if sls
        ]

    reference = [p.detach().clone().requires_grad_(True) for p in params]
    ref_opt = make_optimizer(reference)

    def steps(client: ParameterServerClient, first: int, last: int) -> None:
        for step in range(first, last):
            for i, (p, r) in enumerate(zip(params, reference, strict=True)):
                p.grad = _grad(0, step, p, i)
                r.grad = p.grad.clone()
            client.push_pull([g["lr"] for g in ref_opt.param_groups])
            ref_opt.step()

    shards = shards_for(params)
    for shard in shards:
        register_shard(shard)
    try:
        client = ParameterServerClient(0, params, plan)
        steps(client, 0, 3)
        state = client.gather_state_dict(spec, make_optimizer(params).param_groups)
    finally:
        for shard in shards:
            unregister_shard(shard.shard_id)
    for got, want in zip(params, reference, strict=True):
        # elementwise updates: a slice rounds exactly like the whole tensor
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)
    # the gathered state is the single-device optimizer's, per whole tensor
    want_state = ref_opt.state_dict()
    assert [g["params"] for g in state["param_groups"]] == [g["params"] for g in want_state["param_groups"]]
    for i, want in want_state["state"].items():
        assert state["state"][i].keys() == want.keys()
        for key, v in want.items():
            torch.testing.assert_close(state["state"][i][key], v, rtol=0, atol=0)
    # scattered into fresh shards, it resumes exactly
    fresh = shards_for(params)
    for shard in fresh:
        shard.load_state_dict(state, version=3)
        register_shard(shard)
    try:
        client = ParameterServerClient(0, params, plan)
        client.step = 3
        steps(client, 3, 5)
    finally:
        for shard in fresh:
            unregister_shard(shard.shard_id)
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0)


def test_push_is_one_payload_per_shard() -> None:
    # what crosses the wire: one flat tensor per dtype each way, however many slices
    _, plan, shards = _shards(1, 1)
    params = _model_params()
    reply = shards[0].push(0, 0, [torch.ones_like(params[i]) for i in plan[0]], [0.1, 0.1]).wait()
    assert len(reply.values.flats) == 1 and reply.values.flats[0].shape == (sum(p.numel() for p in params),)


def test_layerwise_optimizers_keep_whole_tensors() -> None:
    from lightning_strategies.optim import Lamb, Lars

    params = [p.clone().requires_grad_(True) for p in _model_params()]
    assert not OptimizerSpec.from_optimizer(Lamb(params, lr=0.1)).elementwise
    assert not OptimizerSpec.from_optimizer(Lars(params, lr=0.1)).elementwise
    assert OptimizerSpec.from_optimizer(torch.optim.Adam(params, lr=0.1)).elementwise


def test_barrier_waits_for_every_worker() -> None:
    _, plan, shards = _shards(1, 2)
    params = _model_params()
    first = shards[0].push(0, 0, [torch.ones_like(params[i]) for i in plan[0]], [0.1, 0.1])
    assert not first.done()
    second = shards[0].push(1, 0, [torch.ones_like(params[i]) for i in plan[0]], [0.1, 0.1])
    assert first.done() and second.done()
    assert first.wait().step_bytes == 2 * 2 * sum(p.numel() * 4 for p in params)


def test_barrier_timeout_names_the_missing_worker() -> None:
    _, _, shards = _shards(1, 3, timeout=timedelta(seconds=0.3))
    grads = [torch.ones(p.shape) for p in _model_params()]
    fut = shards[0].push(0, 0, grads, [0.1, 0.1])
    shards[0].push(2, 0, grads, [0.1, 0.1])
    deadline = time.monotonic() + 10
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    error = fut.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert re.search(r"from worker\(s\) \[1\] \(received from \[0, 2\]\)", error.message)
    # a failed shard refuses later pushes instead of hanging them
    late = shards[0].push(1, 0, grads, [0.1, 0.1]).wait()
    assert isinstance(late, ShardError) and "has failed earlier" in late.message


def test_barrier_starts_one_watchdog_thread_not_one_per_step() -> None:
    _, plan, shards = _shards(1, 2)
    params = _model_params()
    before = threading.active_count()
    for step in range(20):
        for w in range(2):
            shards[0].push(w, step, [torch.ones_like(params[i]) for i in plan[0]], [0.1, 0.1])
    assert threading.active_count() == before + 1
    watchdog = shards[0]._watchdog
    assert watchdog is not None and watchdog.is_alive()
    register_shard(shards[0])
    unregister_shard(0)  # dropping the shard ends its watchdog
    watchdog.join(timeout=5)
    assert not watchdog.is_alive()


def test_barrier_timeout_fires_for_a_step_opened_while_the_watchdog_slept() -> None:
    # the watchdog is not woken for each step's deadline (they only grow): asleep until the first step's, it
    # must still fail a later step that stays open, at that step's own deadline
    timeout = 0.4
    _, plan, shards = _shards(1, 2, timeout=timedelta(seconds=timeout))
    params = _model_params()
    grads = [torch.ones_like(params[i]) for i in plan[0]]
    step, start = 0, time.monotonic()
    while time.monotonic() - start < 1.5 * timeout:  # complete steps past the first step's deadline
        for w in range(2):
            shards[0].push(w, step, grads, [0.1, 0.1])
        step += 1
        time.sleep(0.01)
    opened = time.monotonic()
    fut = shards[0].push(0, step, grads, [0.1, 0.1])  # worker 1 never comes
    while not fut.done() and time.monotonic() - opened < 10:
        time.sleep(0.02)
    waited = time.monotonic() - opened
    error = fut.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert f"gradients of step {step} from worker(s) [1]" in error.message
    assert waited >= timeout * 0.9  # not an earlier step's deadline
    shards[0].close()


def test_a_shard_dropped_after_its_host_failed_answers_with_the_reason() -> None:
    _, plan, shards = _shards(1, 2)
    params = _model_params()
    grads = [torch.ones_like(params[i]) for i in plan[0]]
    waiting = shards[0].push(0, 0, grads, [0.1, 0.1])  # worker 1 never pushes: the barrier stays open
    assert not waiting.done()
    register_shard(shards[0])
    reason = "RuntimeError: worker 0: parameter server shard 1 (hosted by rank 1) failed at step 0"
    unregister_shard(0, reason=reason)
    # the waiting worker is answered at once (not at the barrier's timeout), with the root cause
    error = waiting.wait()
    assert isinstance(error, ShardError) and not error.timed_out
    assert error.message == f"parameter server shard 0 stopped because its host failed: {reason}"
    # a push that reaches the host after the drop gets the same reason, not "plans disagree"
    with pytest.raises(RuntimeError, match=re.escape(error.message)):
        hosted_shard(0)
    register_shard(shards[0])  # a later fit in the process hosts the id again
    assert hosted_shard(0) is shards[0]
    unregister_shard(0)


def test_a_clean_drop_leaves_pending_pushes_pending() -> None:
    _, plan, shards = _shards(1, 2)
    params = _model_params()
    waiting = shards[0].push(0, 0, [torch.ones_like(params[i]) for i in plan[0]], [0.1, 0.1])
    register_shard(shards[0])
    unregister_shard(0)
    assert not waiting.done()


def test_out_of_step_push_is_refused() -> None:
    _, _, shards = _shards(1, 2)
    grads = [torch.ones(p.shape) for p in _model_params()]
    error = shards[0].push(0, 3, grads, [0.1, 0.1]).wait()
    assert isinstance(error, ShardError) and "pushed step 3 while the shard is at step 0" in error.message


def test_async_shard_applies_each_push_alone() -> None:
    # the shard without a barrier ("async"): one worker's push is one optimizer step at once
    params = _model_params()
    spec = OptimizerSpec.from_optimizer(_sgd([p.clone().requires_grad_(True) for p in params]))
    shard = AsyncParameterShard(0, range(len(params)), params, spec, 2)
    grads: list[torch.Tensor | None] = [torch.ones(p.shape) for p in params]
    reply = shard.push_pull(1, grads, [0.1, 0.1], pull=True)
    assert isinstance(reply, AsyncReply) and reply.version == 1
    second = shard.push_pull(0, grads, [0.1, 0.1], pull=True)
    assert isinstance(second, AsyncReply) and second.version == 2


def test_client_gathers_state_shaped_like_the_single_device_optimizer() -> None:
    workers, steps, lrs = 1, 3, [0.1, 0.1, 0.1]
    spec, plan, shards = _shards(2, workers)
    params = [p.clone().requires_grad_(True) for p in _model_params()]
    for shard in shards:
        register_shard(shard)
    try:
        client = ParameterServerClient(0, params, plan)
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = _grad(0, step, p, i)
            client.push_pull(lrs[:1] * 2)
        state = client.gather_state_dict(spec, _sgd(params).param_groups)
    finally:
        for shard in shards:
            unregister_shard(shard.shard_id)
    expected_params, expected_state = _reference(steps, workers, lrs)
    for got, want in zip(params, expected_params, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert [g["params"] for g in state["param_groups"]] == [[0, 1], [2]]
    assert state["param_groups"][1]["weight_decay"] == 0.1
    for i in range(3):
        torch.testing.assert_close(state["state"][i]["momentum_buffer"], expected_state["state"][i]["momentum_buffer"])
    # the gathered state loads into a single-device optimizer and back into fresh shards
    _sgd([p.detach().clone().requires_grad_(True) for p in params]).load_state_dict(state)
    _, _, fresh = _shards(2, workers)
    for shard in fresh:
        shard.load_state_dict(state)
    assert fresh[0].state_dict()["state"].keys() == shards[0].state_dict()["state"].keys()
    torch.testing.assert_close(fresh[1].state_dict()["state"], shards[1].state_dict()["state"])
    assert client.stats.bytes_sent == client.stats.bytes_received == steps * sum(p.numel() * 4 for p in params)


def test_client_skips_empty_shards() -> None:
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD([p.detach().clone().requires_grad_(True) for p in params]))
    plan = shard_parameters([3, 2], 3)  # shard 2 holds nothing and is never contacted
    shards = [ParameterShard(s, idx, [params[i] for i in idx], spec, 1) for s, idx in enumerate(plan) if idx]
    for shard in shards:
        register_shard(shard)
    try:
        client = ParameterServerClient(0, params, plan)
        for p in params:
            p.grad = torch.ones_like(p)
        client.push_pull([0.5])
    finally:
        for shard in shards:
            unregister_shard(shard.shard_id)
    assert all(torch.equal(p.detach(), torch.full_like(p, -0.5)) for p in params)
    assert client.last_server_bytes == [2 * 3 * 4, 2 * 2 * 4, 0]


def test_concurrent_pushes_from_threads_complete_the_step_once() -> None:
    workers = 4
    _, _, shards = _shards(1, workers)
    grads = [torch.ones(p.shape) for p in _model_params()]
    replies: list[Any] = [None] * workers

    def push(w: int) -> None:
        replies[w] = shards[0].push(w, 0, grads, [0.1, 0.1]).wait()

    threads = [threading.Thread(target=push, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert shards[0].version == 1
    assert all(r is not None and r.version == 1 for r in replies)


class _NeedsModel(torch.optim.SGD):
    def __init__(self, params: Any, model: Any) -> None:
        super().__init__(params, lr=0.1)
        self.model = model


def test_optimizer_that_cannot_be_rebuilt_is_reported() -> None:
    opt = _NeedsModel([torch.zeros(2, requires_grad=True)], model=None)
    with pytest.raises(TypeError, match=r"could not rebuild the optimizer.*_NeedsModel.*Fix:"):
        OptimizerSpec.from_optimizer(opt)
    with pytest.raises(TypeError, match=r"which is not a torch\.optim\.Optimizer"):
        OptimizerSpec.from_optimizer(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_servers": 0}, r"num_servers=0\): expected at least 1"),
        ({"rpc_threads": 0}, r"rpc_threads=0\): expected at least 1"),
    ],
)
def test_bad_options_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParameterServerStrategy(**kwargs)


def test_names_are_registered() -> None:
    for name in ("ps", "parameter_server", "ps_fork"):
        assert name in StrategyRegistry
        assert isinstance(StrategyRegistry.get(name), ParameterServerStrategy)
