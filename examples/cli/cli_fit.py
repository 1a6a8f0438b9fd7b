"""LightningCLI with this package's strategies: by name or by class path, options included.

    python examples/cli/cli_fit.py fit --trainer.strategy=ring --trainer.accelerator=cpu --trainer.devices=2
    python examples/cli/cli_fit.py fit --trainer.strategy=lightning_strategies.ParameterServerStrategy \\
        --trainer.strategy.num_servers=1 --trainer.accelerator=cpu --trainer.devices=2
    python examples/cli/cli_fit.py fit --config examples/cli/ps.yaml

A strategy name takes no options (``--trainer.strategy=ring``); a class path takes its options as
``--trainer.strategy.<option>=...`` or under ``init_args`` in YAML.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_strategies  # noqa: F401  (registers the strategy names)


class Regressor(pl.LightningModule):
    """A small regression network trained with SGD."""

    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RandomData(pl.LightningDataModule):
    """``samples`` random points of a fixed linear function."""

    def __init__(self, samples: int = 64, batch_size: int = 8) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=self.batch_size, drop_last=True)


if __name__ == "__main__":
    LightningCLI(Regressor, RandomData)
