"""The blocks of ``benchmarks/pipeline.py``: simulated device compute, real compute, and a Lightning module.

The simulated blocks are a small Linear + tanh (real parameters, gradients and transfers) followed
by a custom autograd function that sleeps in proportion to the micro-batch's rows, forward and
(twice as long) backward: a stand-in for a GPU kernel the CPU waits on. Sleeping stages need no
core, so two of them overlap as two devices would. The real blocks are compute-bound (Linear + tanh).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

__all__ = [
    "HEAVY",
    "LIGHT",
    "SimModule",
    "loss",
    "real_balanced",
    "real_unbalanced",
    "sim_balanced",
    "sim_unbalanced",
]

HEAVY, LIGHT = 8, 1  # costs of the unbalanced model's blocks


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd`` seconds in forward and ``bwd`` in backward (a simulated kernel)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd: float, bwd: float) -> Tensor:
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.bwd)
        return grad, None, None


class _SimBlock(nn.Module):
    """Linear + tanh, then a simulated kernel of ``cost x ms_per_row x rows`` (backward 2x).

    ``table_rows`` adds a parameter table read at one row: parameters without cost.
    """

    def __init__(self, dim: int, cost: float, ms_per_row: float, table_rows: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros(table_rows, dim)) if table_rows else None
        self.seconds_per_row = cost * ms_per_row / 1e3

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.linear(x))
        if self.table is not None:
            y = y + self.table[0]
        fwd = self.seconds_per_row * x.shape[0]
        return _Sleep.apply(y, fwd, 2 * fwd)


class _Dense(nn.Module):
    """Linear + tanh, applied ``repeat`` times with the same weight (compute without parameters)."""

    def __init__(self, dim: int, repeat: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.repeat = repeat

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.repeat):
            x = torch.tanh(self.linear(x))
        return x


class _Table(nn.Module):
    """A Linear plus a large table read at one row: many parameters, little compute."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros(rows, dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x)) + self.table[0]


def sim_balanced(dim: int, n: int, ms_per_row: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_SimBlock(dim, 1, ms_per_row) for _ in range(n)])


def sim_unbalanced(dim: int, ms_per_row: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        _SimBlock(dim, HEAVY, ms_per_row),
        _SimBlock(dim, HEAVY, ms_per_row),
        _SimBlock(dim, LIGHT, ms_per_row, table_rows=4 * dim),
        _SimBlock(dim, LIGHT, ms_per_row, table_rows=4 * dim),
    )


def real_balanced(dim: int, n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Dense(dim) for _ in range(n)])


def real_unbalanced(dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        _Dense(dim, repeat=HEAVY), _Dense(dim, repeat=HEAVY), _Table(dim, 4 * dim), _Table(dim, 4 * dim)
    )


def loss(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


class SimModule(pl.LightningModule):
    """The simulated balanced model of ``n`` blocks as a :class:`~lightning_strategies.PipelineModule`."""

    def __init__(self, dim: int, n: int, ms_per_row: float) -> None:
        super().__init__()
        self.net = sim_balanced(dim, n, ms_per_row)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        value = loss(self(x), y)
        self.log("train_loss", value)
        return value

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
