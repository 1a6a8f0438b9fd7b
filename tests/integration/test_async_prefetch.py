"""``async`` with the training loader in a :class:`DevicePrefetcher` (what ``data.device_prefetch=true``
builds, the default of ``conf/data/imagefolder.yaml``): the strategy rebuilds the loader inside
with its shared batch queue and keeps the prefetcher around it. On CPU the prefetcher passes
batches through; its CUDA copy is tested in ``tests/gpu/test_prefetch_gpu.py``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import AsyncParameterServerStrategy, DevicePrefetcher
from lightning_strategies.strategies.async_ps import DynamicBatchSampler
from tests.lightning_utils import TinyRegressor, quiet_trainer

pytestmark = pytest.mark.slow

N_SAMPLES = 64


class _Indexed(TinyRegressor):
    """Records the sample indices each rank trained on, gathered at each epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.epochs: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.seen.extend(index.tolist())
        return super().training_step((x, y), batch_idx)

    def on_train_epoch_end(self) -> None:
        gathered: list[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, self.seen)
        self.seen = []
        loader = self.trainer.train_dataloader
        assert isinstance(loader, DevicePrefetcher) and isinstance(loader.batch_sampler, DynamicBatchSampler)
        seen = sorted(i for rank in gathered for i in rank)
        self.trainer.callback_metrics[f"seen_{self.current_epoch}"] = torch.tensor(seen)


def _loader(device: str) -> DevicePrefetcher:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    data = TensorDataset(torch.arange(N_SAMPLES), x, torch.tanh(x[:, :4]))
    return DevicePrefetcher(DataLoader(data, batch_size=8, shuffle=True), device)


def _trainer(max_staleness: int | None) -> pl.Trainer:
    timeout = timedelta(seconds=30)
    strategy = AsyncParameterServerStrategy(max_staleness=max_staleness, start_method="fork", timeout=timeout)
    return quiet_trainer(strategy, 2, max_epochs=2)


def test_async_keeps_the_device_prefetcher_and_covers_each_epoch_once() -> None:
    trainer = _trainer(None)
    trainer.fit(_Indexed(), _loader("cpu"))
    for epoch in range(2):  # every sample exactly once per epoch, over both ranks: the shared queue
        assert trainer.callback_metrics[f"seen_{epoch}"].tolist() == list(range(N_SAMPLES)), epoch


def test_async_with_the_prefetcher_and_a_staleness_bound_keeps_the_bound() -> None:
    # the bound is checked where each step starts (not where the prefetcher draws its batch a step
    # ahead), so a prefetcher with max_staleness is accepted; on CPU it passes batches through and
    # its one batch ahead is counted in the lease's flow control only on CUDA
    trainer = _trainer(1)
    trainer.fit(_Indexed(), _loader("cpu"))
    for epoch in range(2):
        assert trainer.callback_metrics[f"seen_{epoch}"].tolist() == list(range(N_SAMPLES)), epoch
    assert float(trainer.callback_metrics["async/clock_gap_max"]) <= 1
