"""PipelineStrategy under mixed precision on fork-started CPU processes, held to one device.

- ``bf16-mixed``: the stages' forward chunks and the loss run under the plugin's autocast, the
  backward chunks outside it, as Lightning runs one device. Compared with ``bf16-mixed`` on one
  device (tolerances at the tests).
- ``16-mixed`` (Lightning turns the ``"16-mixed"`` flag into bf16 on CPU, so the plugin is passed
  as ``MixedPrecision("16-mixed", "cpu")``, torch's CPU autocast and ``GradScaler("cpu")``): an
  inf injected into one rank's gradients skips the step on every rank (stages and replicas),
  and every rank's loss scale halves alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from test_pipeline_strategy import PipeRegressor, fit

from lightning_strategies.strategies.pipeline import PipelineStrategy

pytestmark = pytest.mark.slow


class _Record(pl.Callback):
    """Per step and rank: the loss the module saw, the loss scale after the step, the dtype of the
    outputs the module's training_step received, and whether this rank's own weights changed.
    Written to ``<dir>/rank<r>.json`` at the end (fork-started ranks: files, not return values)."""

    def __init__(self, out: Path, *, inject_at: int | None = None, inject_rank: int | None = None) -> None:
        self.out, self.inject_at, self.inject_rank = out, inject_at, inject_rank
        self.steps: list[dict[str, Any]] = []

    def _own(self, pl_module: pl.LightningModule) -> list[torch.Tensor]:
        return [p.detach().clone() for p in pl_module.parameters() if not p.is_meta]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.before = self._own(pl_module)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # an overflow in one stage of one replica only: the last parameter this rank trains
        if trainer.global_step == self.inject_at and trainer.global_rank == self.inject_rank:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            grads[-1].view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        after = self._own(pl_module)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append(
            {
                "loss": float(outputs["loss"]),
                "scale": scaler.get_scale() if scaler is not None else None,
                "stepped": any(not torch.equal(a, b) for a, b in zip(self.before, after, strict=True)),
                "dtype": str(pl_module.outputs_dtype),  # type: ignore[attr-defined]
            }
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


class DtypeRegressor(PipeRegressor):
    """Keeps the dtype of the outputs its training_step got (the pipeline's, or its own forward's)."""

    outputs_dtype: torch.dtype | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.outputs_dtype = out.dtype
        loss = torch.nn.functional.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss


def _records(out: Path, world: int) -> list[list[dict[str, Any]]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_bf16_mixed_equals_bf16_mixed_on_one_device(tmp_path: Path) -> None:
    """2-stage fits under bf16-mixed against one device under bf16-mixed.

    With one micro-batch (GPipe, M = 1) the pipeline runs the very operations of one device, in
    bf16 where autocast puts them (the activations and their gradients cross stages in bf16
    unchanged), so the weights and every step's loss are bit-identical. With 1F1B and M = 4 the
    forward of a sample does not depend on the micro-batch it travels in (each output row is its
    own dot products), so the first step's loss agrees to float32 rounding of the mean over
    micro-batches (rel 1e-6), while the full-precision model's differs by ~1e-4 relative (bf16's
    2^-9 rounding of the activations; asserted > 1e-5, so a pipeline that forgot autocast fails).
    Its weights: each micro-batch's weight gradient is rounded to bf16 apart (relative 2^-9)
    instead of the batch's once, which over 4 SGD steps at lr 0.05 moves them by ~4e-5 here, so
    atol 2e-4 (a missing micro-batch moves them by > 1e-2).
    """
    dirs = {name: tmp_path / name for name in ("ref", "m1", "m4", "fp32")}
    for d in dirs.values():
        d.mkdir()
    ref, _ = fit("auto", 1, model=DtypeRegressor(), precision="bf16-mixed", callbacks=[_Record(dirs["ref"])])
    m1, _ = fit(
        PipelineStrategy(schedule="gpipe", microbatches=1, start_method="fork"),
        2,
        model=DtypeRegressor(),
        precision="bf16-mixed",
        callbacks=[_Record(dirs["m1"])],
    )
    m4, _ = fit(
        PipelineStrategy(start_method="fork"), 2, model=DtypeRegressor(), precision="bf16-mixed",
        callbacks=[_Record(dirs["m4"])],
    )  # fmt: skip
    fit("auto", 1, model=DtypeRegressor(), callbacks=[_Record(dirs["fp32"])])
    want = [s["loss"] for s in _records(dirs["ref"], 1)[0]]
    for k in ref:
        torch.testing.assert_close(m1[k], ref[k], atol=0, rtol=0, msg=lambda m, k=k: f"M=1 {k}: {m}")
        torch.testing.assert_close(m4[k], ref[k], atol=2e-4, rtol=0, msg=lambda m, k=k: f"M=4 {k}: {m}")
    for rank, (m1_steps, m4_steps) in enumerate(zip(_records(dirs["m1"], 2), _records(dirs["m4"], 2), strict=True)):
        # every rank's module saw the last stage's bf16 outputs
        assert [s["loss"] for s in m1_steps] == want, rank
        assert m4_steps[0]["loss"] == pytest.approx(want[0], rel=1e-6), rank
        assert {s["dtype"] for s in m1_steps + m4_steps} == {"torch.bfloat16"}, rank
    fp32_first = _records(dirs["fp32"], 1)[0][0]["loss"]
    assert abs(fp32_first - want[0]) / want[0] > 1e-5


def test_16_mixed_overflow_on_one_rank_skips_the_step_everywhere(tmp_path: Path) -> None:
    """2 replicas x 2 stages under 16-mixed; an inf in rank 3's gradients (replica 1, stage 1) at step 2.

    Every rank must skip step 2 (its own weights unchanged) and step at the others, and every
    rank's loss scale must be the same after each step: 65536 until step 2, halved to 32768 by
    it (torch's defaults: init_scale 2^16, backoff 0.5, growth only after 2000 clean steps). Without
    the agreement ranks 0-2 would step at 2 and keep 65536.
    """
    out = tmp_path / "pipe"
    out.mkdir()
    fit(
        PipelineStrategy(num_stages=2, start_method="fork"),
        4,
        batch_size=8,
        distributed_sampler=True,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        model=DtypeRegressor(),
        callbacks=[_Record(out, inject_at=2, inject_rank=3)],
    )
    records = _records(out, 4)
    for rank, steps in enumerate(records):
        assert [s["stepped"] for s in steps] == [True, True, False, True], rank
        assert [s["scale"] for s in steps] == [65536.0, 65536.0, 32768.0, 32768.0], rank
        assert {s["dtype"] for s in steps} == {"torch.float16"}, rank


def test_16_mixed_equals_16_mixed_on_one_device_with_the_skipped_step() -> None:
    """The same overflow on one device skips the same step: the pipeline ends with its weights.

    fp16 keeps 11 significant bits: each micro-batch's weight gradient is rounded apart (relative
    2^-12), which over 3 applied steps moves weights by ~1e-6; atol 5e-5 (a step applied on one
    stage but not the other moves them by > 1e-3).
    """
    ref, _ = fit(
        "auto", 1, model=DtypeRegressor(), plugins=[MixedPrecision("16-mixed", "cpu")],
        callbacks=[_Inject(2)],
    )  # fmt: skip
    pipe, _ = fit(
        PipelineStrategy(start_method="fork"),
        2,
        model=DtypeRegressor(),
        plugins=[MixedPrecision("16-mixed", "cpu")],
        callbacks=[_Inject(2, rank=0)],
    )
    for k in ref:
        torch.testing.assert_close(pipe[k], ref[k], atol=5e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


class _Inject(pl.Callback):
    """An inf in the first gradient this rank holds, at ``step`` (on ``rank`` only)."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            next(p.grad for p in pl_module.parameters() if p.grad is not None).view(-1)[0] = float("inf")
