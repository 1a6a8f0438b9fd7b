"""``ring`` under ``16-mixed``: every rank's GradScaler sees the same overflow, because the ring
all-reduces the gradients before any scaler looks at them.

Lightning turns the ``"16-mixed"`` flag into bf16 on CPU, so the plugin is passed as
``MixedPrecision("16-mixed", "cpu")`` (torch's CPU fp16 autocast and ``GradScaler("cpu")``). At
step ``INJECT_AT`` rank 1's *local* gradient of the last layer's bias gets an inf, through a hook
on the parameter, which runs before DDP hands the bucket to the ring. The ring carries it to every
rank, so every scaler finds the inf: each rank skips that step (its weights do not move) and
halves its scale, and the ranks end with identical weights, equal to DDP's under the same
injection (P = 2: the ring's sums equal gloo's bit for bit, so compared exactly).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor, fit_weights

from lightning_strategies.strategies.ring import RingAllReduceStrategy

pytestmark = pytest.mark.slow

INJECT_AT, INJECT_RANK, STEPS = 2, 1, 5


class _InfOnOneRank(pl.Callback):
    """Injects the inf on one rank before the all-reduce; records each step per rank to a file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []
        self.trainer: pl.Trainer | None = None

    def _inject(self, grad: torch.Tensor) -> torch.Tensor:
        trainer = self.trainer
        if trainer is not None and trainer.global_step == INJECT_AT and trainer.global_rank == INJECT_RANK:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        # a hook on the parameter runs before its gradient is accumulated, so before DDP's
        # reducer sees it: the inf is in this rank's local gradient only
        list(pl_module.parameters())[-1].register_hook(self._inject)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        after = list(pl_module.parameters())
        self.steps.append({
            "scale": float(scaler.get_scale()),
            "stepped": any(not torch.equal(a, b) for a, b in zip(self.before, after, strict=True)),
        })  # fmt: skip

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = {k: v.tolist() for k, v in pl_module.state_dict().items()}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"steps": self.steps, "weights": weights}))


def _fit(strategy: Any, out: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    out.mkdir()
    weights = fit_weights(
        strategy, 2, max_steps=STEPS, model=TinyRegressor(), callbacks=[_InfOnOneRank(out)],
        plugins=[MixedPrecision("16-mixed", "cpu")],
    )  # fmt: skip
    return weights, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    ring, ring_ranks = _fit(RingAllReduceStrategy(start_method="fork"), tmp_path / "ring")
    ddp, ddp_ranks = _fit(DDPStrategy(start_method="fork"), tmp_path / "ddp")
    for rank, record in enumerate(ring_ranks):
        stepped = [s["stepped"] for s in record["steps"]]
        scales = [s["scale"] for s in record["steps"]]
        assert stepped == [step != INJECT_AT for step in range(STEPS)], (rank, stepped)
        init = scales[0]  # GradScaler's 65536: no growth within 2000 steps
        assert scales == [init if step < INJECT_AT else init / 2 for step in range(STEPS)], (rank, scales)
        assert record["steps"] == ddp_ranks[rank]["steps"], rank  # DDP decides the same, step by step
    assert ring_ranks[0]["weights"] == ring_ranks[1]["weights"]  # the replicas agree, bit for bit
    for k in ddp:
        assert torch.equal(ring[k], ddp[k]), k  # P = 2: the same sums, the same skipped step
    assert max(float((ring[k] - TinyRegressor().state_dict()[k]).abs().max()) for k in ring) > 1e-4  # it trained
