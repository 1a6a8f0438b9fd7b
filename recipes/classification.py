"""The recipes' LightningModule: image classification with torchmetrics accuracy.

It is written the plain way (loss from ``self(x)``, optimizer over the parameters) and also
implements the pipeline contract (``pipeline_layers`` / ``pipeline_loss``) so the same module
runs under every strategy.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_strategies.scaling import ScalingConfig, ScalingPlan, replicas_of
from recipes.models import as_blocks

__all__ = ["ClassificationModule", "ThroughputMonitor"]

# Step-level metrics are logged unsynchronised on purpose: a per-step all-reduce of the loss
# would add a collective to every step and distort the strategies' communication figures.
warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting.*")

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class ClassificationModule(pl.LightningModule):
    """Cross-entropy classification of ``model``'s logits.

    Args:
        model: maps images to logits.
        num_classes: classes of the task.
        optimizer: a partial optimizer (Hydra ``_partial_: true``), called with the parameter
            groups and the *scaled* lr.
        scaling: the scaling rule and schedule; the lr the optimizer config gives is the base lr.
        no_decay_norm_bias: put biases and norm weights in a group without weight decay or
            layer adaptation (Goyal et al. §5.1; You et al. 2020).
        label_smoothing: as in ``nn.CrossEntropyLoss``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_classes: int,
        optimizer: OptimizerFactory,
        scaling: ScalingConfig | None = None,
        no_decay_norm_bias: bool = False,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scaling = scaling or ScalingConfig(rule="none")
        self.no_decay_norm_bias = no_decay_norm_bias
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.plan: ScalingPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    # The pipeline contract (lightning_strategies.PipelineModule).
    def pipeline_layers(self) -> nn.Sequential:
        return as_blocks(self.model)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_acc(logits.detach(), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", self.criterion(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test_loss", self.criterion(logits, y), sync_dist=True)
        self.log("test_acc", self.test_acc)

    def _parameter_groups(self, weight_decay: float) -> Iterable[Any]:
        if not self.no_decay_norm_bias:
            return [p for p in self.parameters() if p.requires_grad]
        from lightning_strategies.optim import param_groups

        return param_groups(self, weight_decay)

    def configure_optimizers(self) -> Any:
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        per_device = int(getattr(datamodule, "batch_size", 0)) or 1
        base_lr = float(self.optimizer_factory.keywords["lr"]) if hasattr(self.optimizer_factory, "keywords") else None
        if base_lr is None:
            raise ValueError("the optimizer config must give an lr (the base lr at scaling.base_batch_size)")
        self.plan = self.scaling.plan(
            base_lr=base_lr,
            per_device=per_device,
            replicas=replicas_of(trainer.strategy),
            accumulate=trainer.accumulate_grad_batches,
        )
        rank_zero_info(self.plan.describe())
        weight_decay = float(self.optimizer_factory.keywords.get("weight_decay", 0.0))  # type: ignore[attr-defined]
        optimizer = self.optimizer_factory(self._parameter_groups(weight_decay), lr=self.plan.lr)
        total = int(trainer.estimated_stepping_batches)
        epochs = max(1, trainer.max_epochs or 1)
        steps_per_epoch = max(1, total // epochs)
        scheduler = self.scaling.scheduler(optimizer, self.plan, steps_per_epoch=steps_per_epoch, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ThroughputMonitor(pl.Callback):
    """Logs ``throughput/samples_per_s`` each training epoch (all replicas together), and
    records the validation accuracy reached against wall time since ``fit`` started.

    Time runs from the epoch's first batch to its last ``on_train_batch_end``, so validation
    and checkpointing are not counted; samples are this rank's times the data-parallel replicas.
    """

    def __init__(self) -> None:
        self.epoch_rates: list[float] = []
        self.val_curve: list[tuple[float, float]] = []  # (seconds since fit start, val_acc)
        self._fit_start = 0.0
        self._start: float | None = None
        self._last: float = 0.0
        self._samples = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("val_acc")
        if not trainer.sanity_checking and acc is not None:
            self.val_curve.append((time.perf_counter() - self._fit_start, float(acc)))

    def time_to_val_acc(self, target: float) -> float | None:
        """Seconds from the start of ``fit`` to the first validation at ``target`` or better."""
        return next((t for t, acc in self.val_curve if acc >= target), None)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._samples = None, 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += len(batch[0]) if isinstance(batch, list | tuple) else len(batch)
        self._last = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is None or self._last <= self._start:
            return
        rate = self._samples * replicas_of(trainer.strategy) / (self._last - self._start)
        self.epoch_rates.append(rate)
        pl_module.log("throughput/samples_per_s", rate, rank_zero_only=True)

    def samples_per_s(self) -> float:
        """Median rate over epochs after the first (which pays for warm-up), or the only one."""
        rates = self.epoch_rates[1:] or self.epoch_rates
        return float(torch.tensor(rates).median()) if rates else float("nan")
