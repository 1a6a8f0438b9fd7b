"""What every strategy shares (``strategies/_base.py``, ``strategies/_model_parallel.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
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


def _fill(window: MetricsWindow, wrap: Callable[[float], Any]) -> None:
    """The same samples as test_metrics_window_means_peaks_and_latest, each passed through ``wrap``."""
    for step in range(1, 5):
        window.add(bytes=wrap(100.0 * step), seconds=wrap(0.5))
        window.peak(server_max=wrap(step % 3))
        window.latest(clock=wrap(step))
    window.add(staleness=wrap(2.0), seconds=0.5)  # a float into a tensor sum, and the reverse below
    window.add(staleness=4.0)
    window.peak(server_max=1.5)


def test_metrics_window_takes_tensors_with_the_float_paths_values() -> None:
    floats, tensors = MetricsWindow(), MetricsWindow()
    _fill(floats, float)
    _fill(tensors, lambda v: torch.tensor(v, dtype=torch.float32))  # float32 in, float64 sums inside
    want = floats.flush()
    got = tensors.flush()
    assert list(got) == list(want)  # same keys, same order
    # float32 holds every sample exactly (multiples of 0.5 below 2**24) and the sums are float64:
    # the same numbers as Python floats, not merely close
    assert got == want
    assert all(type(v) is float for v in got.values())
    assert not tensors


def test_metrics_window_reads_the_device_only_at_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _f: Any = original) -> Any:
            reads.append(_name)
            return _f(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    window = MetricsWindow()
    for _ in range(3):  # several windows: each costs exactly one read, whatever its length
        _fill(window, lambda v: torch.tensor(v))
        assert reads == []  # add / peak / latest never read a tensor (on CUDA: never wait)
        window.flush()
        assert reads == ["tolist"]  # one stacked transfer for sums, maxima and latest together
        reads.clear()


def test_metrics_window_refuses_a_tensor_of_several_values() -> None:
    with pytest.raises(ValueError, match=r"found loss with shape \(2,\): expected one value.*Fix: reduce"):
        MetricsWindow().add(loss=torch.ones(2))
    window = MetricsWindow()
    window.add(loss=torch.ones(1, 1, requires_grad=True))  # one element of any shape, detached
    assert window.flush() == {"loss": 1.0}


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
