"""What every strategy shares (``strategies/_base.py``, ``strategies/_model_parallel.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    RingAllReduceStrategy,
    TensorParallelStrategy,
)
from lightning_strategies.checkpoint import AtomicCheckpointIO
from lightning_strategies.strategies._base import MetricsWindow, StrategyBase, divisors
from lightning_strategies.strategies._model_parallel import ModelParallelStrategy

NO_DDP_WRAPPER = [ParameterServerStrategy, AsyncParameterServerStrategy, PipelineStrategy, TensorParallelStrategy]


def test_metrics_window_means_peaks_and_latest() -> None:
    window = MetricsWindow()
    assert not window
    for step in range(1, 5):
        window.add(bytes=100.0 * step, seconds=0.5)
        window.peak(server_max=step % 3)
        window.latest(clock=step)
    window.add(staleness=2.0)  # a value with fewer samples than steps: its own mean
    window.add(staleness=4.0)
    assert window
    assert window.flush() == {
        "bytes": 250.0,  # (100 + 200 + 300 + 400) / 4
        "seconds": 0.5,
        "staleness": 3.0,
        "server_max": 2.0,
        "clock": 4.0,
    }
    assert not window and window.flush() == {}


def test_every_strategy_shares_the_base() -> None:
    for cls in [RingAllReduceStrategy, *NO_DDP_WRAPPER]:
        assert issubclass(cls, StrategyBase), cls
        strategy = cls()
        assert strategy.trainer is None and not strategy.failed and not strategy.metrics
        assert isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    assert issubclass(PipelineStrategy, ModelParallelStrategy)
    assert issubclass(TensorParallelStrategy, ModelParallelStrategy)


@pytest.mark.parametrize("cls", NO_DDP_WRAPPER)
def test_strategies_without_a_ddp_wrapper_refuse_its_options(cls: type) -> None:
    with pytest.raises(TypeError, match=r"got \['find_unused_parameters'\].*does not wrap the model.*Fix: drop"):
        cls(find_unused_parameters=True)
    cls(timeout=None, process_group_backend="gloo", start_method="fork")  # the launch options are fine


def test_ring_keeps_ddps_options() -> None:
    strategy = RingAllReduceStrategy(find_unused_parameters=True, static_graph=False)
    assert strategy._ddp_kwargs["find_unused_parameters"] is True


@pytest.mark.parametrize(
    ("strategy", "size", "replicas"),
    [
        (PipelineStrategy(), 4, 1),
        (PipelineStrategy(num_stages=2), 2, 2),
        (TensorParallelStrategy(), 4, 1),
        (TensorParallelStrategy(tp_size=2), 2, 2),
    ],
)
def test_model_parallel_size_and_replicas(strategy: Any, size: int, replicas: int) -> None:
    env = LightningEnvironment()  # as the Trainer sets it: 4 processes, this one rank 3
    env.set_world_size(4)
    env.set_global_rank(3)
    strategy.cluster_environment = env
    assert (strategy.model_parallel_size, strategy.replicas) == (size, replicas)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": replicas, "rank": 3 // size}


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
