"""The Lightning plugins :class:`~lightning_strategies.strategies.pipeline.PipelineStrategy` installs.

- :class:`PipelinePrecision`: 32-bit precision whose clipping by norm uses the norm over all stages.
- :class:`StageSyncBatchNorm`: ``Trainer(sync_batchnorm=True)`` with batch-norm statistics synced
  over the replicas of a stage (its data-parallel group), not over the world.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["PipelinePrecision", "StageSyncBatchNorm", "convert_sync_batchnorm"]


class PipelinePrecision(Precision):
    """32-bit precision whose clipping by norm uses the norm over *all* stages.

    Each rank holds the gradients of its stages only, so ``clip_grad_norm_`` over its own
    parameters would clip each stage by its own norm. Here the squared norms are summed over
    the pipeline group first (replicas hold identical, already averaged gradients).

    Args:
        group: returns the pipeline's process group (``None`` before the pipeline exists).
    """

    def __init__(self, group: Callable[[], dist.ProcessGroup | None]) -> None:
        super().__init__()
        self._group = group

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        group = self._group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total = float(sq.sqrt())
        # torch.nn.utils.clip_grad_norm_'s rule: scale by clip / (norm + 1e-6), never up
        coef = min(1.0, float(clip_val) / (total + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)


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
