"""What each torchrun worker of ``test_async_hierarchical_torchrun.py`` runs (2 "nodes" x 2 processes).

Five tiny fits in a row on the same processes, each a fresh ``Trainer`` over :class:`TinyRegressor` with plain
SGD, 2 epochs of an indexed regression set (batch 4 per process):

- ``async_hier_bsp``: ``AsyncParameterServerStrategy(max_staleness=0)`` (hierarchical on 2 nodes), lr 0.02;
- ``async_flat_bsp``: the same with ``hierarchical=False``, lr 0.01 (each of its 4 workers' pushes is one
  batch's, where the node's is the mean of 2: the same step per sample, the module docstring of the test);
- ``ps_hier``: ``ParameterServerStrategy()`` (hierarchical), lr 0.04 = 0.02 x 2 nodes (its one step per round
  averages what the 2 nodes push one after the other);
- ``async_hier_free`` (no bound) and ``async_hier_tail`` (no bound, 100 samples: the epoch's last unit holds
  one batch, split 2 + 2 samples): the bytes, and every sample trained once per epoch.

Every rank saves its weights to ``<out-dir>/<fit>_rank<r>.pt`` and writes ``<out-dir>/rank<r>.json``: per fit,
whether the push was hierarchical, the client, the node layout, the shard plan's elements per shard, the
``comm/`` metrics it logged last, the (epoch, sample indices, weight, weights' checksum) of every step, its
lease's admissions (leaders) and, on rank 0, the coordinator's clock log and admissions.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from _ps_hier_torchrun import PushRecord, run_fits
from lightning_utils import TinyRegressor, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import AsyncParameterServerStrategy, ParameterServerStrategy

EPOCHS = 2
BATCH = 4
#: fit name -> (strategy, lr, samples)
FITS: dict[str, tuple[str, float, int]] = {
    "async_hier_bsp": ("async_hier_bsp", 0.02, 96),
    "async_flat_bsp": ("async_flat_bsp", 0.01, 96),
    "ps_hier": ("ps_hier", 0.04, 96),
    "async_hier_free": ("async_hier_free", 0.02, 96),
    "async_hier_tail": ("async_hier_free", 0.02, 100),
}


def make_strategy(name: str) -> pl.strategies.Strategy:
    timeout = timedelta(seconds=60)
    if name == "async_hier_bsp":
        return AsyncParameterServerStrategy(max_staleness=0, timeout=timeout)
    if name == "async_flat_bsp":
        return AsyncParameterServerStrategy(max_staleness=0, hierarchical=False, timeout=timeout)
    if name == "async_hier_free":
        return AsyncParameterServerStrategy(timeout=timeout)
    return ParameterServerStrategy(timeout=timeout)


class IndexedRegressor(TinyRegressor):
    """:class:`TinyRegressor` with plain SGD, recording per step (epoch, sample indices, this process's weight in
    its node's step, a float64 checksum of the weights it trains on)."""

    def __init__(self, lr: float) -> None:
        super().__init__(optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr))
        self.steps: list[tuple[int, list[int], float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        weight = float(getattr(self.trainer.strategy.client, "weight", 1.0))  # type: ignore[attr-defined]
        checksum = sum(float((p.double() * (i + 1)).sum()) for i, p in enumerate(self.parameters()))
        self.steps.append((self.current_epoch, idx.tolist(), weight, checksum))
        return nn.functional.mse_loss(self(x), y)


def indexed_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    return TensorDataset(x, torch.tanh(x @ w), torch.arange(n))


class _Record(PushRecord):
    """ps's record (layout, shard plan, ``comm/`` values), and async's steps, lease and clocks."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        strategy = trainer.strategy
        self.record["steps"] = pl_module.steps  # type: ignore[attr-defined]
        if isinstance(strategy, AsyncParameterServerStrategy):
            lease = strategy.batch_lease
            self.record["lease_admissions"] = list(lease.admissions) if lease is not None else None
            strategy.barrier()  # every node has pushed its last step
            coordinator = strategy.coordinator
            if coordinator is not None:
                self.record["clock_log"] = [list(row) for row in coordinator.clock_log]
                self.record["admissions"] = [list(row) for row in coordinator.admissions]


def one_fit(strategy: str, lr: float, samples: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = IndexedRegressor(lr)
    keep = _Record()
    trainer = quiet_trainer(make_strategy(strategy), 2, num_nodes=2, max_epochs=EPOCHS, callbacks=[keep])
    trainer.fit(model, DataLoader(indexed_data(samples), batch_size=BATCH))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, keep.record


if __name__ == "__main__":
    run_fits(FITS, one_fit, every_rank=True, description=__doc__.splitlines()[0])
