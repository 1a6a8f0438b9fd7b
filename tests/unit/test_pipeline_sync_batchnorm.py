"""PipelineStrategy with ``Trainer(sync_batchnorm=True)``: synced over a stage's replicas on CUDA, refused on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning_utils import TinyRegressor, one_process_group_cleanup, regression_data
from torch import nn
from torch.utils.data import DataLoader

from lightning_strategies.strategies._pipeline_plugins import StageSyncBatchNorm, convert_sync_batchnorm
from lightning_strategies.strategies.pipeline import PipelineStrategy


class PipeBatchNormRegressor(TinyRegressor):
    """TinyRegressor whose net has a batch-norm layer, plus the two protocol methods."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    """A process group of this process alone (the stand-in for a stage's data-parallel group)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    new = dist.new_group([0], backend="gloo")
    assert isinstance(new, dist.ProcessGroup)
    yield new
    dist.destroy_process_group(new)
    if owned:
        dist.destroy_process_group()


def test_conversion_gives_every_batch_norm_the_stage_group(group: dist.ProcessGroup) -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4)
    )
    converted = convert_sync_batchnorm(model, group)  # built on CPU; no forward (SyncBatchNorm needs a GPU)
    synced = [m for m in converted.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert len(synced) == 2
    assert all(m.process_group is group for m in synced)
    assert not any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in converted.modules())


def test_plugin_converts_over_the_group_it_is_given(group: dist.ProcessGroup) -> None:
    model = PipeBatchNormRegressor()
    converted = StageSyncBatchNorm(lambda: group).apply(model)
    synced = [m for m in converted.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert len(synced) == 1 and synced[0].process_group is group
    assert model.pipeline_layers()[1] is synced[0]  # the blocks the pipeline cuts hold the synced layer


def test_sync_batchnorm_on_cpu_is_refused_at_setup_with_the_fix() -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=PipelineStrategy(),
        sync_batchnorm=True,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    refused = r"found Trainer\(sync_batchnorm=True\) on CPU: expected CUDA.*Fix: drop"
    with one_process_group_cleanup(), pytest.raises(ValueError, match=refused):
        trainer.fit(PipeBatchNormRegressor(), DataLoader(regression_data(), batch_size=8))
