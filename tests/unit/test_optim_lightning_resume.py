"""Resume inside a Lightning fit: Lamb's and Lars' state go through the checkpoint intact.

The split is at an epoch boundary, by ``max_epochs``: a plain DataLoader cannot be
fast-forwarded, so Lightning 2.6 restarts the data from its first batch when a fit stopped by
``max_steps`` (mid-epoch, or on an epoch's last batch) is resumed, and the batches would no
longer match the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_strategies.optim import Lamb, Lars
from tests.lightning_utils import TinyRegressor, regression_data

STEPS_PER_EPOCH = 8  # 64 samples / batch 8


def _fit(model: pl.LightningModule, epochs: int, ckpt_path: str | None = None) -> pl.Trainer:
    loader = DataLoader(regression_data(), batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def _weights(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


FACTORIES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "lamb": lambda p: Lamb(p, lr=2e-2, weight_decay=0.01),
    "lars": lambda p: Lars(p, lr=0.5, trust_coefficient=0.02, nesterov=True),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_resumed_fit_ends_with_the_uninterrupted_weights(name: str, tmp_path: Path) -> None:
    straight = TinyRegressor(FACTORIES[name])
    _fit(straight, epochs=2)  # 16 steps

    part = TinyRegressor(FACTORIES[name])
    trainer = _fit(part, epochs=1)  # 8 steps
    assert trainer.global_step == STEPS_PER_EPOCH
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert saved["state"][0]["momentum_buffer" if name == "lars" else "exp_avg"].abs().sum() > 0

    resumed = TinyRegressor(FACTORIES[name])  # fresh weights and optimizer, then the checkpoint
    trainer = _fit(resumed, epochs=2, ckpt_path=str(ckpt))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH

    # The same float32 ops on the same batches in the same order: identical, not just close.
    for key, value in _weights(straight).items():
        torch.testing.assert_close(_weights(resumed)[key], value, rtol=0, atol=0, msg=key)
    # and the run moved the weights (a resume that restored nothing would not match above)
    assert not torch.equal(_weights(part)["net.0.weight"], _weights(straight)["net.0.weight"])
