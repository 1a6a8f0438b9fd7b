"""The Lightning plugins :class:`~lightning_strategies.strategies.pipeline.PipelineStrategy` installs
besides :class:`~lightning_strategies.strategies._model_parallel.GroupNormPrecision`.

- :class:`StageSyncBatchNorm`: ``Trainer(sync_batchnorm=True)`` with batch-norm statistics synced
  over the replicas of a stage (its data-parallel group), not over the world.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn
from typing_extensions import override

__all__ = ["StageSyncBatchNorm", "convert_sync_batchnorm"]


def convert_sync_batchnorm(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """``model`` with every batch-norm layer a ``SyncBatchNorm`` whose statistics are reduced over ``group``."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)


class StageSyncBatchNorm(TorchSyncBatchNorm):
    """``sync_batchnorm=True`` for a pipeline: batch norm synced across the replicas of a stage.

    Every rank holds the whole model but runs only its stages' blocks, so a layer's statistics can
    only be reduced among the ranks that run it: the stage's data-parallel group. Lightning applies
    this plugin at the start of fit and reverts it (to plain batch norm) at its end, as it does
    its own :class:`~lightning.pytorch.plugins.TorchSyncBatchNorm`.

    Args:
        group: returns the data-parallel group of this rank's stages.
    """

    def __init__(self, group: Callable[[], dist.ProcessGroup | None]) -> None:
        self._group = group

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        group = self._group()
        assert group is not None, "the device mesh is built (setup_environment) before the model is set up"
        return convert_sync_batchnorm(model, group)
