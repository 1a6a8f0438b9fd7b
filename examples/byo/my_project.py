"""Your own LightningModule and LightningDataModule, trained by the app under any strategy.

Nothing here imports the app: the app finds these classes through ``_target_`` in
``conf/model/mlp.yaml`` and ``conf/data/blobs.yaml`` (next to this file). Run from the repository root:

    PYTHONPATH=examples/byo python train.py --config-dir examples/byo/conf recipe=blobs_mlp
    PYTHONPATH=examples/byo python train.py --config-dir examples/byo/conf recipe=blobs_mlp \\
        trainer=ddp_sim strategy=ring                                  # 2 processes, our ring all-reduce

What the app gives a module, by constructor parameter name (each optional; with ``_partial_: true``):
``optimizer`` (the optimizer group, a partial taking params and lr), ``scaling`` (the scaling rule,
a ``ScalingConfig``) and ``plan`` (``ScalingPlan``: this run's global batch and scaled lr), and
``num_classes`` / ``in_channels`` when the DataModule has them. What it needs from a DataModule:
an int ``batch_size`` attribute its loaders use (for ``global_batch_size`` and the scaling rule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import PrefetchConfig, ScalingConfig, ScalingPlan

__all__ = ["BlobsDataModule", "MLPClassifier"]


class MLPClassifier(pl.LightningModule):
    """A two-layer perceptron; the app passes ``num_classes``, ``optimizer``, ``scaling`` and ``plan``.

    Args:
        in_features: input width (``${data.features}`` in the config).
        num_classes: classes (the DataModule's ``num_classes``, passed by the app).
        hidden: hidden width.
        optimizer: builds the optimizer from parameters and an lr; SGD when not given.
        scaling: the batch-size scaling rule; with ``plan`` it gives the warmup/decay schedule.
        plan: the run's global batch and lr scaled to it; ``lr`` is used when not given.
        lr: the lr without a plan.
    """

    def __init__(
        self,
        *,
        in_features: int,
        num_classes: int,
        hidden: int = 64,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scaling: ScalingConfig | None = None,
        plan: ScalingPlan | None = None,
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scaling", "plan"])
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        self.optimizer_factory = optimizer or functools.partial(torch.optim.SGD, momentum=0.9)
        self.scaling, self.plan = scaling, plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    # strategy=pipeline splits pipeline_layers() into stages (lightning_strategies.PipelineModule)
    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        lr = self.plan.lr if self.plan is not None else self.hparams["lr"]
        optimizer = self.optimizer_factory(self.parameters(), lr=lr)
        if self.scaling is None or self.plan is None:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        per_epoch = max(1, total // max(1, self.trainer.max_epochs or 1))
        schedule = self.scaling.scheduler(optimizer, self.plan, steps_per_epoch=per_epoch, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class BlobsDataModule(pl.LightningDataModule):
    """Gaussian blobs, one per class, split into train/val/test (seeded).

    ``batch_size`` is the per-device batch (the app sets it from ``global_batch_size``); the loader
    settings are ``lightning_strategies.PrefetchConfig``'s, checked when built.
    """

    def __init__(
        self,
        *,
        batch_size: int = 32,
        num_samples: int = 1024,
        features: int = 16,
        num_classes: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size, self.num_samples, self.features = batch_size, num_samples, features
        self.num_classes, self.seed = num_classes, seed
        self.prefetch = PrefetchConfig(num_workers=num_workers, pin_memory=pin_memory)
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        centers = 3 * torch.randn(self.num_classes, self.features, generator=generator)
        y = torch.randint(0, self.num_classes, (self.num_samples,), generator=generator)
        x = centers[y] + torch.randn(self.num_samples, self.features, generator=generator)
        n_val = n_test = self.num_samples // 8
        n_train = self.num_samples - n_val - n_test
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        self.val_set = TensorDataset(x[n_train : n_train + n_val], y[n_train : n_train + n_val])
        self.test_set = TensorDataset(x[n_train + n_val :], y[n_train + n_val :])

    def _loader(self, dataset: TensorDataset | None, *, train: bool = False) -> DataLoader:
        assert dataset is not None, "setup() has not run"
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=train, drop_last=train, **self.prefetch.loader_kwargs()
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set)
