"""The precision and batch-norm plugins :class:`~lightning_strategies.strategies.pipeline.PipelineStrategy` installs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_strategies.comm.amp import agree_found_inf, ensure_scale
from lightning_strategies.strategies._model_parallel import GroupNormClipping, GroupNormPrecision

__all__ = [
    "PipelineMixedPrecision",
    "StageSyncBatchNorm",
    "convert_sync_batchnorm",
    "pipeline_precision",
    "stage_layer_sync",
]


class PipelineMixedPrecision(GroupNormClipping, MixedPrecision):
    """``bf16-mixed`` / ``16-mixed`` for a pipeline: autocast in the stages, one loss scale for all ranks.

    Under ``16-mixed`` the last stage scales its loss, each rank unscales its own gradients and
    :func:`~lightning_strategies.comm.amp.agree_found_inf` takes the overflow verdict over the world,
    so an inf on any rank skips the step everywhere. Clipping is
    :class:`~lightning_strategies.strategies._model_parallel.GroupNormClipping`'s.

    Args: ``GroupNormClipping``'s ``group`` (the pipeline's, for the clipping norm) and ``device`` (returns this
    rank's device), then ``MixedPrecision``'s ``precision``, ``device`` (the autocast device type) and ``scaler``.
    """

    def check_optimizer(self, optimizer: Optimizer) -> None:
        """Refuse, under ``16-mixed``, an optimizer that unscales inside its own ``step`` (fused ones):
        the overflow verdict could not be agreed before it steps."""
        if self.scaler is not None and _optimizer_handles_unscaling(optimizer):
            raise ValueError(
                f"PipelineStrategy found {type(optimizer).__name__} with a fused step under precision='16-mixed': "
                "expected an optimizer that the gradient scaler unscales before its step, since every stage "
                "must agree on skipping an overflowing step first. Fix: pass fused=False, or use "
                "precision='bf16-mixed' (no loss scaling)."
            )

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        # MixedPrecision.optimizer_step with the verdict agreed between unscale_ and step.
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "PipelineStrategy found LBFGS under precision='16-mixed': expected another optimizer, since AMP "
                "and LBFGS are not compatible. Fix: use precision='bf16-mixed' or another optimizer."
            )
        self.check_optimizer(optimizer)
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if skip_unscaling:  # every rank skips alike: the closure result is the step's, known everywhere
            self._after_closure(model, optimizer)
            return closure_result
        device = self._device()
        ensure_scale(self.scaler, device)
        self.scaler.unscale_(optimizer)
        agree_found_inf(self.scaler, optimizer, device)
        self._after_closure(model, optimizer)
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output


def convert_sync_batchnorm(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """``model`` with every batch-norm layer a ``SyncBatchNorm`` whose statistics are reduced over ``group``."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)


class StageSyncBatchNorm(TorchSyncBatchNorm):
    """``sync_batchnorm=True`` for a pipeline: batch norm synced over the replicas of a stage (the
    ranks that run it), applied and reverted by Lightning as its own ``TorchSyncBatchNorm``.

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


def pipeline_precision(
    plugin: Precision, group: Callable[[], dist.ProcessGroup | None], device: Callable[[], torch.device]
) -> Precision:
    """The Trainer's precision as a plugin that knows the pipeline (group-norm clipping, one loss scale);
    ``ValueError`` for a plugin other than ``32-true``, ``bf16-mixed`` or ``16-mixed``."""
    if isinstance(plugin, PipelineMixedPrecision) or type(plugin) is GroupNormPrecision:
        return plugin
    if type(plugin) is MixedPrecision:
        return PipelineMixedPrecision(group, device, plugin.precision, plugin.device, plugin.scaler)
    if type(plugin) is Precision:
        return GroupNormPrecision(group, device)
    raise ValueError(
        f"PipelineStrategy found the precision plugin {type(plugin).__name__}: expected 32-true, bf16-mixed or "
        "16-mixed (the schedule runs each stage's forward under the plugin's autocast and its backward "
        "itself). Fix: use Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed')."
    )


def stage_layer_sync(
    layer_sync: LayerSync | None, device: torch.device, replicas: int, dp_group: Callable[[], dist.ProcessGroup | None]
) -> LayerSync | None:
    """``Trainer(sync_batchnorm=True)``'s plugin as one syncing over a stage's replicas (none with one);
    ``ValueError`` off CUDA, where torch's ``SyncBatchNorm`` does not run."""
    if layer_sync is None or isinstance(layer_sync, StageSyncBatchNorm):
        return layer_sync
    if device.type != "cuda":
        raise ValueError(
            f"PipelineStrategy found Trainer(sync_batchnorm=True) on {device.type.upper()}: "
            "expected CUDA devices, since torch's SyncBatchNorm runs on GPUs only. Fix: drop "
            "sync_batchnorm=True (each replica of a stage then normalises with its own micro-batch "
            "statistics), or train on GPUs."
        )
    if replicas == 1:
        rank_zero_info(
            "PipelineStrategy: sync_batchnorm=True syncs a stage's batch norm over its replicas, and "
            "this run has one: plain batch norm is used."
        )
        return None
    return StageSyncBatchNorm(dp_group)
