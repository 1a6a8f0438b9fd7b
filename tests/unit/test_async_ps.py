"""The asynchronous parameter-server pieces in one process: a shard applying pushes at once and
measuring staleness, the coordinator's clock gate and data queue, and the strategy's options."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_strategies  # noqa: F401  (registers "async")
from lightning_strategies.comm.async_ps import AsyncParameterShard, AsyncReply
from lightning_strategies.comm.coordinator import AsyncCoordinator, DataPlan, Draw
from lightning_strategies.comm.ps import OptimizerSpec
from lightning_strategies.comm.rpc import ShardError
from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy, DynamicBatchSampler


def _shard(staleness_lr: Any = "none", workers: int = 2) -> AsyncParameterShard:
    p = torch.zeros(3, requires_grad=True)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD([p], lr=1.0))
    return AsyncParameterShard(0, [0], [p], spec, workers, staleness_lr=staleness_lr)


def _push(shard: AsyncParameterShard, worker: int, value: float, *, pull: bool = True, lr: float = 1.0) -> AsyncReply:
    reply = shard.push_pull(worker, [torch.full((3,), value)], [lr], pull=pull)
    assert isinstance(reply, AsyncReply)
    return reply


# --------------------------------------------------------------------------------------------
# Shard
# --------------------------------------------------------------------------------------------


def test_shard_applies_each_push_at_once_and_counts_staleness() -> None:
    shard = _shard()
    first = _push(shard, 0, 1.0)  # worker 0 computed on version 0: fresh
    assert first.staleness == 0 and first.version == 1 and first.values is not None
    torch.testing.assert_close(first.values.flats[0], torch.full((3,), -1.0))  # one flat payload
    # worker 1 never pulled: its gradient was computed on version 0, one update ago
    second = _push(shard, 1, 1.0, pull=False)
    assert second.staleness == 1 and second.values is None and second.version == 2
    # worker 0 pulled at version 1; one update (worker 1's) since
    assert _push(shard, 0, 0.0).staleness == 1
    assert shard.clocks == [2, 1]
    assert list(shard.log) == [(0, 1, 0), (1, 1, 1), (0, 2, 1)]
    assert shard.staleness_max == 1 and shard.staleness_sum == 2 and shard.pushes == 3
    torch.testing.assert_close(shard.params[0].detach(), torch.full((3,), -2.0))


def test_pull_resets_the_base_version() -> None:
    shard = _shard()
    _push(shard, 0, 1.0)
    _push(shard, 0, 1.0)
    pulled = shard.pull(1)
    assert isinstance(pulled, AsyncReply) and pulled.staleness == -1 and pulled.version == 2
    assert _push(shard, 1, 1.0).staleness == 0


def test_inverse_staleness_lr_divides_by_one_plus_staleness() -> None:
    shard = _shard("inverse")
    _push(shard, 0, 1.0)  # fresh: full step of -1
    _push(shard, 0, 1.0)
    _push(shard, 0, 1.0)
    # worker 1 is 3 updates stale: lr 1 / (1 + 3)
    assert _push(shard, 1, 1.0).staleness == 3
    torch.testing.assert_close(shard.params[0].detach(), torch.full((3,), -3.25))


def test_shard_refuses_bad_pushes_with_a_message() -> None:
    shard = _shard()
    bad = shard.push_pull(5, [torch.zeros(3)], [1.0], pull=True)
    assert isinstance(bad, ShardError) and "expected a worker in [0, 2)" in bad.message
    bad = shard.push_pull(0, [torch.zeros(3), torch.zeros(3)], [1.0], pull=True)
    assert isinstance(bad, ShardError) and "pushed 2 gradients, expected 1" in bad.message
    with pytest.raises(ValueError, match=r"staleness_lr='half': expected one of \['none', 'inverse'\]"):
        _shard("half")


# --------------------------------------------------------------------------------------------
# Coordinator
# --------------------------------------------------------------------------------------------

PLAN = DataPlan(num_samples=20, batch_size=4, drop_last=False, shuffle=True, seed=3)


def _draw(c: AsyncCoordinator, worker: int, clock: int, epoch: int = 0, plan: DataPlan = PLAN) -> Draw | None:
    """The answer if given at once, else ``None`` (the draw is held by the gate)."""
    fut = c.draw(worker, epoch, clock, plan)
    if not fut.done():
        return None
    result = fut.value()
    assert isinstance(result, Draw), result
    return result


def test_plan_batches_cover_the_samples_once() -> None:
    batches = PLAN.batches(0)
    assert [len(b) for b in batches] == [4] * 5 and sorted(i for b in batches for i in b) == list(range(20))
    assert PLAN.batches(1) != batches  # a new permutation per epoch
    assert DataPlan(10, 4, drop_last=True, shuffle=False).batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert DataPlan(10, 4).num_batches == 3
    with pytest.raises(ValueError, match="batch_size=0"):
        DataPlan(10, 0)


def test_unbounded_queue_hands_out_every_batch_once() -> None:
    c = AsyncCoordinator(2, None)
    got = [_draw(c, 0, clock) for clock in range(4)]  # worker 0 races ahead, never held
    assert all(d is not None and d.indices is not None and d.waited == 0.0 for d in got)
    last = _draw(c, 1, 0)
    assert last is not None and last.indices is not None
    assert sorted(i for d in [*got, last] for i in d.indices or []) == list(range(20))
    end = _draw(c, 0, 4)
    assert end is not None and end.indices is None  # the epoch is over
    assert c.served(0) == [4, 1] and c.remaining(0) == 0


def test_queue_keeps_a_batch_for_a_worker_that_has_not_drawn() -> None:
    c = AsyncCoordinator(3, None)
    answers = [_draw(c, 0, clock) for clock in range(5)]
    # 5 batches, 3 workers: worker 0 gets 3, the last two are kept for workers 1 and 2
    assert [a is not None and a.indices is not None for a in answers] == [True, True, True, False, False]
    assert _draw(c, 2, 0) is not None and _draw(c, 1, 0) is not None
    assert c.served(0) == [3, 1, 1]


def test_gate_holds_a_worker_more_than_s_ahead_until_the_slow_one_pushes() -> None:
    c = AsyncCoordinator(2, 1, timeout=timedelta(seconds=30))
    plan = DataPlan(100, 1)
    assert _draw(c, 0, 0, plan=plan) is not None
    assert _draw(c, 0, 1, plan=plan) is not None  # 1 ahead of worker 1 (clock 0): allowed with s=1
    held = c.draw(0, 0, 2, plan)  # 2 ahead: held
    assert not held.done() and c.blocked_draws == [1, 0]
    c.tick(1, 1)  # worker 1 pushes its first step
    assert held.done()
    answer = held.value()
    assert isinstance(answer, Draw) and answer.indices is not None and answer.blocked and answer.waited > 0
    # every admission had the worker at most s ahead of the slowest other
    assert all(clock - low <= 1 for _, clock, low in c.admissions)
    assert list(c.clock_log) == [(1, 0), (2, 0), (2, 1)]


def test_zero_staleness_is_a_bulk_synchronous_schedule() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(100, 1)
    assert _draw(c, 0, 0, plan=plan) is not None
    held = c.draw(0, 0, 1, plan)
    assert not held.done()
    assert _draw(c, 1, 0, plan=plan) is not None
    c.tick(1, 1)
    assert held.done()


def test_first_draw_of_an_epoch_is_not_gated_when_the_loader_fetches_ahead() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(100, 1)
    c.tick(0, 3)  # worker 0 ended the last epoch 3 pushes ahead
    fut = c.draw(0, 1, 3, plan, ahead=True)
    assert fut.done()  # fetched ahead, before any step of the epoch
    assert not c.draw(0, 1, 3, plan, ahead=True).done()  # the start of its first step is gated


def test_fetching_ahead_the_end_of_the_epoch_is_gated_too() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(2, 1)
    assert c.draw(0, 0, 0, plan, ahead=True).done() and c.draw(1, 0, 0, plan, ahead=True).done()
    c.tick(0, 1)
    last = c.draw(0, 0, 1, plan, ahead=True)  # "no more batches" at the start of step 2: held
    assert not last.done()
    c.tick(1, 1)
    answer = last.value()
    assert isinstance(answer, Draw) and answer.indices is None
    # without fetching ahead, "no more batches" starts no step and is answered at once
    c2 = AsyncCoordinator(2, 0)
    assert c2.draw(0, 0, 0, plan).done() and c2.draw(1, 0, 0, plan).done()
    c2.tick(0, 1)
    assert c2.draw(0, 0, 1, plan).done()


def test_gated_draw_times_out_naming_the_missing_worker() -> None:
    c = AsyncCoordinator(3, 0, timeout=timedelta(seconds=0.2))
    plan = DataPlan(100, 1)
    _draw(c, 0, 0, plan=plan)
    fut = c.draw(0, 0, 1, plan)
    error = fut.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert "worker 0 (clock 1) waited 0s for worker(s) [1, 2]" in error.message
    assert "raise the strategy's `timeout`" in error.message


def test_failed_worker_fails_the_waiting_draws_at_once() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(100, 1)
    _draw(c, 0, 0, plan=plan)
    fut = c.draw(0, 0, 1, plan)
    c.fail(1, "RuntimeError: boom")
    error = fut.wait()
    assert isinstance(error, ShardError) and "worker 1 failed: RuntimeError: boom" in error.message


def test_workers_must_agree_on_the_plan() -> None:
    c = AsyncCoordinator(2, None)
    _draw(c, 0, 0)
    other = DataPlan(20, 5)
    result = c.draw(1, 0, 0, other).wait()
    assert isinstance(result, ShardError) and "make train_dataloader() identical on all ranks" in result.message


def test_concurrent_draws_cover_the_epoch_once() -> None:
    c = AsyncCoordinator(4, 1, timeout=timedelta(seconds=20))
    plan = DataPlan(400, 2)
    taken: list[list[int]] = [[] for _ in range(4)]

    def worker(w: int) -> None:
        clock = 0
        while (answer := c.draw(w, 0, clock, plan).wait()) is not None:
            assert isinstance(answer, Draw)
            if answer.indices is None:
                return
            taken[w].extend(answer.indices)
            clock += 1
            c.tick(w, clock)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert sorted(i for t in taken for i in t) == list(range(400))
    assert all(clock - low <= 1 for _, clock, low in c.admissions)


# --------------------------------------------------------------------------------------------
# Strategy options, sampler, registry
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_staleness": -1}, ValueError, r"max_staleness=-1\): expected an integer >= 0 .* or None"),
        ({"max_staleness": 1.5}, ValueError, r"max_staleness=1.5\): expected an integer"),
        ({"max_staleness": True}, ValueError, r"max_staleness=True\)"),
        ({"push_every": 0}, ValueError, r"push_every=0\): expected an integer >= 1.*Fix: pass push_every=1"),
        ({"pull_every": "2"}, ValueError, r"pull_every='2'\): expected an integer >= 1"),
        ({"timeout": 30}, TypeError, r"timeout=30\): expected a datetime.timedelta.*timedelta\(seconds=30\)"),
        ({"staleness_lr": "sqrt"}, ValueError, r"staleness_lr='sqrt'\): expected one of \['none', 'inverse'\]"),
        ({"num_servers": 0}, ValueError, r"num_servers=0\): expected at least 1 server shard"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        AsyncParameterServerStrategy(**kwargs)


def test_options_are_kept() -> None:
    s = AsyncParameterServerStrategy(
        max_staleness=2, push_every=3, pull_every=4, staleness_lr="inverse", timeout=timedelta(seconds=9)
    )
    assert (s.max_staleness, s.push_every, s.pull_every, s.staleness_lr) == (2, 3, 4, "inverse")
    assert s.ps_timeout == timedelta(seconds=9)


def test_registered_names() -> None:
    assert "async" in StrategyRegistry and "async_fork" in StrategyRegistry
    assert StrategyRegistry["async"]["strategy"] is AsyncParameterServerStrategy
    assert StrategyRegistry["async_fork"]["init_params"] == {"start_method": "fork"}


def test_dynamic_sampler_draws_until_the_queue_is_empty_and_has_no_length() -> None:
    queue = [[0, 1], [2, 3]]
    calls: list[int] = []

    def draw(epoch: int, plan: DataPlan) -> list[int] | None:
        calls.append(epoch)
        return queue.pop(0) if queue else None

    sampler = DynamicBatchSampler(DataPlan(4, 2), draw, lambda: 7)
    assert list(sampler) == [[0, 1], [2, 3]] and calls == [7, 7, 7]
    assert not hasattr(sampler, "__len__")


def test_warns_when_momentum_plus_asynchrony_exceeds_one() -> None:
    import warnings

    import torch

    from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy

    strategy = AsyncParameterServerStrategy(parallel_devices=[torch.device("cpu")] * 2)
    params = [torch.nn.Parameter(torch.zeros(2))]
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    with pytest.warns(UserWarning, match=r"implicit momentum of about 0.50 to the optimizer's 0.9.*momentum=0.5"):
        strategy._warn_high_momentum()
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._warn_high_momentum()  # 0.5 + 0.5 is not above 1: no warning
