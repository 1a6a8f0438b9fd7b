"""Mixed precision under ``"ps"`` and ``"async"`` on fork-started CPU processes.

``16-mixed`` on CPU: Lightning turns ``precision="16-mixed"`` into bf16 on CPU, so these fits pass
``MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))`` as a plugin: fp16 autocast and a
real gradient scaler, as on a GPU. An overflow is forced on rank 1 only (an infinite loss at one
step). Under ``"ps"`` both ranks must skip that step together, end with DDP's weights under the
same scaler and the same (halved) scale; under ``"async"`` rank 1 alone skips its push and lowers
its scale, and nothing waits for the push it skipped.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import lightning_strategies  # noqa: F401  (registers the strategies)
from lightning_strategies.comm.amp import AgreedGradScaler
from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
from tests.lightning_utils import GlobalBatchSampler, TinyRegressor, fit_weights, quiet_trainer, regression_data

pytestmark = pytest.mark.slow

INIT_SCALE = 2.0**16  # GradScaler's default; growth_interval (2000) is never reached here
OVERFLOW_AT = 2  # rank 1's third training step


def fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))


class _OverflowOnRank1(TinyRegressor):
    """An infinite loss on rank 1 at its step ``OVERFLOW_AT``: its gradients hold infs and NaNs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.calls += 1
        if self.global_rank == 1 and self.calls == OVERFLOW_AT + 1:
            loss = loss * float("inf")
        return loss


class _ScalerRecord(pl.Callback):
    """Each rank's scale after every step; at the end every rank's list, gathered into rank 0's
    callback_metrics (which the fork launcher returns to the parent)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        self.scales.append(float(scaler.get_scale()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        pushes = -1
        if isinstance(strategy, ParameterServerStrategy) and strategy.client is not None:
            pushes = strategy.client.step
        mine = {"scales": self.scales, "steps": getattr(pl_module, "calls", -1), "pushes": pushes}
        scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
        mine["agreed"] = isinstance(scaler, AgreedGradScaler) and scaler.agree
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, mine)
        for r, record in enumerate(gathered):
            trainer.callback_metrics[f"rec/scales_{r}"] = torch.tensor(record["scales"])
            trainer.callback_metrics[f"rec/steps_{r}"] = torch.tensor(record["steps"])
            trainer.callback_metrics[f"rec/pushes_{r}"] = torch.tensor(record["pushes"])
            trainer.callback_metrics[f"rec/agreed_{r}"] = torch.tensor(record["agreed"])


@functools.cache
def _ddp_fp16() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _fit(DDPStrategy(start_method="fork"))


def _fit(strategy: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """6 steps of global batch 16 under fp16 with rank 1's overflow; rank 0's weights and the records
    (the fork launcher returns rank 0's callback_metrics to this process)."""
    record = _ScalerRecord()
    model = _OverflowOnRank1()
    data = regression_data()
    loader = DataLoader(data, batch_size=8, sampler=GlobalBatchSampler(len(data), 8))
    trainer = quiet_trainer(
        strategy,
        2,
        max_steps=6,
        use_distributed_sampler=False,
        log_every_n_steps=1,
        plugins=[fp16_plugin()],
        callbacks=[record],
    )
    trainer.fit(model, loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, dict(trainer.callback_metrics)


def test_ps_fp16_overflow_on_one_rank_skips_the_step_everywhere_like_ddp() -> None:
    ps = ParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30))
    got, metrics = _fit(ps)
    want, ddp_metrics = _ddp_fp16()
    # Both skip step OVERFLOW_AT and take the same other steps. The scale is a power of two, so
    # unscaling is exact and DDP's (g0 S/2 + g1 S/2) / S and the shard's g0/2 + g1/2 of the
    # unscaled gradients round alike: bit-identical, as the fp32 parity test.
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    halved = [INIT_SCALE] * OVERFLOW_AT + [INIT_SCALE / 2] * (6 - OVERFLOW_AT)
    for r in (0, 1):
        assert bool(metrics[f"rec/agreed_{r}"])
        # every rank's scaler backed off at the same step, as DDP's did
        assert metrics[f"rec/scales_{r}"].tolist() == ddp_metrics[f"rec/scales_{r}"].tolist() == halved
        assert int(metrics[f"rec/pushes_{r}"]) == 5  # 6 steps, one skipped by both ranks: no push
    # the skip, logged from the scaler's device flag at log_every_n_steps=1: the last step stepped
    assert float(metrics["amp/step_skipped"]) == 0.0
    assert torch.isfinite(torch.cat([v.flatten() for v in got.values()])).all()


def test_async_fp16_overflow_skips_only_that_workers_push_and_nothing_waits_for_it() -> None:
    strategy = AsyncParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30), max_staleness=0)
    record = _ScalerRecord()
    trainer = quiet_trainer(strategy, 2, max_epochs=1, plugins=[fp16_plugin()], callbacks=[record])
    model = _OverflowOnRank1()
    # 96 samples in batches of 8: 12 batches, ~6 per worker under the bulk-synchronous bound
    trainer.fit(model, DataLoader(regression_data(n=96), batch_size=8))
    metrics = trainer.callback_metrics
    steps = [int(metrics[f"rec/steps_{r}"]) for r in (0, 1)]
    pushes = [int(metrics[f"rec/pushes_{r}"]) for r in (0, 1)]
    assert sum(steps) == 12 and steps[1] > OVERFLOW_AT, steps
    # rank 1 skipped its own push of the overflowing step, rank 0 pushed every step
    assert pushes == [steps[0], steps[1] - 1], (steps, pushes)
    scales0, scales1 = metrics["rec/scales_0"].tolist(), metrics["rec/scales_1"].tolist()
    assert scales0 == [INIT_SCALE] * steps[0]  # rank 0's scaler never saw the overflow
    assert scales1 == [INIT_SCALE] * OVERFLOW_AT + [INIT_SCALE / 2] * (steps[1] - OVERFLOW_AT)
    assert not bool(metrics["rec/agreed_0"]) and not bool(metrics["rec/agreed_1"])  # each decides alone
    # no inf reached the shards: the weights every rank pulled at the end are finite
    assert all(torch.isfinite(p).all() for p in model.parameters())


@functools.cache
def _ddp_bf16() -> dict[str, torch.Tensor]:
    return fit_weights(DDPStrategy(start_method="fork"), 2, precision="bf16-mixed")


def test_ps_bf16_mixed_equals_ddp_bf16_mixed() -> None:
    ps = ParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30))
    got = fit_weights(ps, 2, precision="bf16-mixed")
    want = _ddp_bf16()
    # autocast runs the same bf16 kernels on the same weights and batches under both; the
    # gradients land in fp32 and are averaged as in the fp32 parity test (g0/2 + g1/2): identical
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    # and bf16 did change the arithmetic: the fp32 run differs
    fp32 = fit_weights(DDPStrategy(start_method="fork"), 2)
    assert not torch.equal(fp32["net.0.weight"], want["net.0.weight"])


def test_async_bf16_mixed_one_worker_equals_a_single_device_bf16_run() -> None:
    loader = DataLoader(regression_data(), batch_size=8)

    def fit(strategy: Any) -> dict[str, torch.Tensor]:
        model = TinyRegressor()
        # the loader's own order (0..63) for both: a DDP-based strategy would get Lightning's
        # shuffling DistributedSampler even at one process
        trainer = quiet_trainer(strategy, 1, max_epochs=2, precision="bf16-mixed", use_distributed_sampler=False)
        trainer.fit(model, loader)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    got = fit(AsyncParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30)))
    want = fit("auto")
    # one worker: each push is one SGD step on the shard, on the batches in the loader's order, with
    # the single device's bf16 gradients: bit-identical
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
