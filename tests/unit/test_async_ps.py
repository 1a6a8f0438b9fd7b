"""The asynchronous parameter-server pieces in one process: a shard applying pushes at once and
measuring staleness, and the strategy's options (the coordinator and the lease:
``test_async_coordinator.py``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_strategies  # noqa: F401  (registers "async")
from lightning_strategies.comm.async_ import DataPlan
from lightning_strategies.comm.async_ps import AsyncParameterShard, AsyncReply
from lightning_strategies.comm.ps import OptimizerSpec
from lightning_strategies.comm.rpc import ShardError
from lightning_strategies.strategies.async_elastic import AsyncElasticStrategy
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
        ({"lease": 0}, ValueError, r"lease=0\): expected an integer >= 1 .*Fix: pass lease=4"),
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
    assert StrategyRegistry["async_elastic"]["init_params"] == {"dedicated_servers": True, "num_servers": 1}


def test_dedicated_servers_options_are_checked() -> None:
    assert StrategyRegistry["async_elastic"]["strategy"] is AsyncElasticStrategy
    with pytest.raises(ValueError, match=r"start_method='fork'\): Lightning's 'fork' launcher ends every process"):
        AsyncElasticStrategy(dedicated_servers=True, start_method="fork")
    strategy = AsyncElasticStrategy(dedicated_servers=True, parallel_devices=[torch.device("cpu")])
    members = strategy.members
    assert members.num_servers == 1 and strategy.num_servers == 1  # the default: one server, rank 0
    with pytest.raises(ValueError, match=r"num_servers=1\) with 1 processes: expected at least one worker"):
        members.check_world(strategy.num_nodes * strategy.num_processes)
    cpus = [torch.device("cpu")] * 4
    two = AsyncElasticStrategy(dedicated_servers=True, num_servers=2, parallel_devices=cpus)
    assert two.workers == [2, 3] and two._num_workers == 2
    assert two.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}  # the chief validates on everything
    # the plain strategy has no membership: the option names the class that has it
    with pytest.raises(TypeError, match=r"dedicated_servers=True\).*Fix: AsyncElasticStrategy"):
        AsyncParameterServerStrategy(dedicated_servers=True)


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

    from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy, _warn_high_momentum

    strategy = AsyncParameterServerStrategy(parallel_devices=[torch.device("cpu")] * 2)
    params = [torch.nn.Parameter(torch.zeros(2))]
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    with pytest.warns(UserWarning, match=r"implicit momentum of about 0.50 to the optimizer's 0.9.*momentum=0.5"):
        _warn_high_momentum(strategy._num_workers, strategy.optimizers)
    strategy.optimizers = [torch.optim.SGD(params, lr=0.1, momentum=0.5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_high_momentum(strategy._num_workers, strategy.optimizers)  # 0.5 + 0.5 is not above 1: no warning


def test_push_every_mean_leaves_out_the_steps_the_gradient_scaler_skipped() -> None:
    strategy = AsyncParameterServerStrategy(push_every=3)
    g = [torch.tensor([1.0, 2.0]), None]
    h = [torch.tensor([3.0, 6.0]), None]
    assert strategy._accumulated.add(g, take=False) is g
    assert strategy._accumulated.add(None, take=False) is None  # skipped (an overflow): not added
    mean = strategy._accumulated.add(h, take=True)
    assert mean is not None and mean[1] is None
    torch.testing.assert_close(mean[0], torch.tensor([2.0, 4.0]), rtol=0, atol=0)  # (g + h) / 2, not / 3
    # a push whose every step was skipped has nothing to push; the sums start afresh
    assert strategy._accumulated.add(None, take=False) is None
    assert strategy._accumulated.add(None, take=True) is None
    torch.testing.assert_close(strategy._accumulated.add(g, take=True)[0], g[0], rtol=0, atol=0)  # type: ignore[index]


def test_a_push_without_pull_still_reports_the_shards_bytes() -> None:
    # ps/server_bytes_max comes from each reply's step_bytes: a push that pulls nothing carries its bytes in too
    from lightning_strategies.comm.async_ps import AsyncParameterServerClient
    from lightning_strategies.comm.ps import register_shard, unregister_shard

    shard = _shard(workers=1)
    register_shard(shard)
    try:
        client = AsyncParameterServerClient(0, [p.detach().clone() for p in shard.params], [[0]])
        grads = [torch.ones_like(p) for p in shard.params]
        client.push(grads, [0.1], pull=False)
        assert client.last_server_bytes == [4 * shard.params[0].numel()]  # the gradient in, no values out
        client.push(grads, [0.1], pull=True)
        assert client.last_server_bytes == [2 * 4 * shard.params[0].numel()]
    finally:
        unregister_shard(0)
