"""The ``"ring"`` strategy trains like DDP and logs its communication."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor, fit_weights, regression_data
from torch.utils.data import DataLoader

from lightning_strategies.strategies.ring import RingAllReduceStrategy

pytestmark = pytest.mark.slow

N_PARAMS = 8 * 16 + 16 + 16 * 4 + 4  # TinyRegressor: Linear(8, 16) + Linear(16, 4)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _loss(weights: dict[str, torch.Tensor] | None) -> float:
    model = TinyRegressor()
    if weights is not None:
        model.load_state_dict(weights)
    x, y = regression_data().tensors
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


@pytest.mark.parametrize("devices", [2, 3])
def test_ring_trains_like_ddp(devices: int) -> None:
    ddp = fit_weights(DDPStrategy(start_method="fork"), devices, batch_size=8)
    ring = fit_weights(RingAllReduceStrategy(start_method="fork"), devices, batch_size=8)
    # Both average the same per-rank gradients; DDP divides by P then lets gloo's ring sum,
    # ours sums in another ring order then divides. With P=2 both are exact (a+b is
    # commutative, /2 exact), so the weights are equal. With P=3 the gradients differ by ~1 ulp
    # (~6e-8 relative); six SGD-momentum steps with lr=0.05 move that by far less than 1e-6.
    assert _max_diff(ddp, ring) <= (0.0 if devices == 2 else 1e-6)


def test_ring_with_gradient_accumulation_trains_like_ddp() -> None:
    kwargs: dict[str, Any] = {"batch_size": 4, "accumulate_grad_batches": 2, "max_steps": 3}
    ddp = fit_weights(DDPStrategy(start_method="fork"), 2, **kwargs)
    ring = fit_weights(RingAllReduceStrategy(start_method="fork"), 2, **kwargs)
    assert _max_diff(ddp, ring) == 0.0  # P=2: exact, as above; no_sync must skip the ring


def test_bf16_wire_stays_within_bf16_rounding_and_still_learns() -> None:
    ddp = fit_weights(DDPStrategy(start_method="fork"), 2, batch_size=8)
    bf16 = fit_weights(RingAllReduceStrategy(start_method="fork", wire_dtype="bf16"), 2, batch_size=8)
    # Each averaged gradient element is rounded to bfloat16 at most twice (partial sum, final
    # value): relative error <= 2^-8. SGD with momentum 0.9 and lr 0.05 turns a gradient error
    # e at step j into a weight error of lr * sum_{k>=j} 0.9^(k-j) * e; summed over 6 steps that
    # is < 0.05 * 23.2 * 2^-8 * max|grad| = 4.5e-3 * max|grad|, with |grad| < 1 on this model.
    assert _max_diff(ddp, bf16) <= 4.5e-3
    assert _max_diff(ddp, bf16) > 0.0  # it really went through bfloat16
    assert _loss(bf16) < 0.9 * _loss(None)


@pytest.mark.parametrize(("wire_dtype", "itemsize"), [(None, 4), ("bf16", 2)])
def test_comm_metrics_reach_callback_metrics_and_the_logger(
    tmp_path: Path, wire_dtype: str | None, itemsize: int
) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=RingAllReduceStrategy(start_method="fork", wire_dtype=wire_dtype),
        max_steps=3,
        logger=CSVLogger(tmp_path, name="ring"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(), DataLoader(regression_data(), batch_size=8))
    # One bucket holds every gradient (212 float32 < 25 MiB); with P=2 each rank sends exactly
    # half of it in reduce-scatter and half in all-gather: 2(P-1)/P x numel x wire itemsize.
    per_step = 2 * (2 - 1) / 2 * N_PARAMS * itemsize
    metrics = trainer.callback_metrics
    assert float(metrics["comm/bytes_sent"]) == per_step
    assert float(metrics["comm/bytes_received"]) == per_step
    assert float(metrics["comm/calls"]) == 1.0
    assert 0.0 < float(metrics["comm/seconds"]) < 5.0
    files = list(tmp_path.rglob("metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("comm/bytes_sent")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(float(r["comm/bytes_sent"]) == per_step for r in rows), rows
