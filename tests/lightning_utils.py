"""A tiny deterministic Lightning fit, for comparing a strategy's weights with a reference.

Used by the strategy tests: the same seed, data and optimizer under ``ddp`` and under a
strategy of ours must end with the same weights (up to a tolerance the test justifies).
Processes are fork-started (``start_method="fork"``), ~0.2 s to the first step instead of
~5.5 s for ``popen``, and the parent gets rank 0's final weights back from Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def sgd_momentum(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class TinyRegressor(pl.LightningModule):
    """Two linear layers, no batch norm (so data-parallel math equals single-device math); with
    ``batchnorm``, a ``BatchNorm1d`` after the first (for the buffers' tests)."""

    def __init__(
        self, optimizer_factory: OptimizerFactory = sgd_momentum, in_dim: int = 8, *, batchnorm: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(16)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(in_dim, 16), *norm, nn.Tanh(), nn.Linear(16, 4))
        self.optimizer_factory = optimizer_factory
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())


class StopAfter(pl.Callback):
    """Save ``path`` and stop after global step ``step`` (or, with ``epoch``, after that epoch),
    at a batch end (``where="batch"``) or at the epoch end (``where="epoch"``)."""

    def __init__(self, where: str, path: Path, *, step: int | None = None, epoch: int | None = None) -> None:
        self.where, self.path, self.step, self.epoch = where, path, step, epoch

    def _maybe_stop(self, trainer: pl.Trainer) -> None:
        due = trainer.global_step == self.step if self.epoch is None else trainer.current_epoch == self.epoch
        if due and not trainer.should_stop:
            trainer.save_checkpoint(self.path)  # every rank calls it: ps and pipeline gather
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.where == "batch":
            self._maybe_stop(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.where == "epoch":
            self._maybe_stop(trainer)


def regression_data(n: int = 64, in_dim: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=g)
    w = torch.randn(in_dim, 4, generator=g)
    return TensorDataset(x, torch.tanh(x @ w))


class GlobalBatchSampler(Sampler[int]):
    """Gives replica r of R the r-th slice of each contiguous global batch of ``R * batch_size``.

    Lightning's own DistributedSampler shuffles and strides, so a 1-device run of the same
    global batch would see other samples; with this sampler (and
    ``use_distributed_sampler=False``) step k of any world size covers samples
    ``[k*R*B, (k+1)*R*B)``, exactly as the single-device reference does. A replica is
    ``ranks_per_replica`` consecutive ranks (a tensor-parallel group), which all get its slice.
    """

    def __init__(self, n: int, batch_size: int, ranks_per_replica: int = 1) -> None:
        self.n = n
        self.batch_size = batch_size
        self.ranks_per_replica = ranks_per_replica

    def _replica(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() // self.ranks_per_replica, dist.get_world_size() // self.ranks_per_replica
        return 0, 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        replica, replicas = self._replica()
        step = self.batch_size * replicas
        for start in range(0, self.n - step + 1, step):
            yield from range(start + replica * self.batch_size, start + (replica + 1) * self.batch_size)

    def __len__(self) -> int:
        _, replicas = self._replica()
        return (self.n // (self.batch_size * replicas)) * self.batch_size


def quiet_trainer(strategy: Any, devices: int, *, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    """A Trainer for tests: no logger, checkpoints, progress bar or model summary (``kwargs`` add
    options or override these)."""
    options: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def fit_weights(
    strategy: Any,
    devices: int,
    *,
    max_steps: int = 6,
    batch_size: int = 8,
    model: pl.LightningModule | None = None,
    **trainer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Fit :class:`TinyRegressor` (or ``model``) and return the final weights of rank 0.

    ``batch_size`` is per device, so a 2-device run sees the same global batch of 16 samples
    as a 1-device run with ``batch_size=16``.
    """
    model = model if model is not None else TinyRegressor()
    data = regression_data()
    loader = DataLoader(data, batch_size=batch_size, sampler=GlobalBatchSampler(len(data), batch_size))
    trainer = quiet_trainer(strategy, devices, max_steps=max_steps, use_distributed_sampler=False, **trainer_kwargs)
    trainer.fit(model, loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class WarmupRegressor(TinyRegressor):
    """Linear warmup per step: a parameter server must use the learning rate the worker's scheduler set."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


@functools.cache
def ddp_reference_weights(
    devices: int,
    optimizer_factory: OptimizerFactory = sgd_momentum,
    accumulate: int = 1,
    clip: tuple[tuple[str, Any], ...] = (),
) -> dict[str, torch.Tensor]:
    """:func:`fit_weights` of Lightning's DDP (fork-started) on :class:`TinyRegressor`, once per setting: the
    reference the data-parallel strategies' tests compare with (``clip``: the Trainer's clipping options)."""
    return fit_weights(
        DDPStrategy(start_method="fork"),
        devices,
        model=TinyRegressor(optimizer_factory=optimizer_factory),
        accumulate_grad_batches=accumulate,
        **dict(clip),
    )


def steps_trainer(strategy: Any, devices: int, max_steps: int, **kwargs: Any) -> pl.Trainer:
    """:func:`quiet_trainer` for ``max_steps`` steps of :func:`global_loader`'s batches (no distributed sampler)."""
    return quiet_trainer(strategy, devices, max_steps=max_steps, use_distributed_sampler=False, **kwargs)


def global_loader(batch_size: int = 8) -> DataLoader:
    """:func:`regression_data` in the contiguous global batches of :class:`GlobalBatchSampler`."""
    data = regression_data()
    return DataLoader(data, batch_size=batch_size, sampler=GlobalBatchSampler(len(data), batch_size))


class SaveAtEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` at the end of fit: every rank calls it (the shards' state is gathered)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class ManualRegressor(TinyRegressor):
    """:class:`TinyRegressor` under manual optimization (what the parameter servers refuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


@contextmanager
def one_process_group_cleanup() -> Iterator[None]:
    """Destroy the default process group a one-process fit in the test process made (a fit that
    fails at setup leaves it), so later tests start without one; a group that existed stays."""
    initialized = dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized() and not initialized:
            dist.destroy_process_group()
