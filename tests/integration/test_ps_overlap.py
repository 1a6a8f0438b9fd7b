"""``strategy="ps"`` with pushes overlapped with backward and pulls with the next forward, on 2 fork-started
CPU processes: the overlap happens (the client's timestamps), the weights stay DDP's (also with gradient
accumulation, and with the shards answering each bucket alone), and ``overlap=False`` still equals DDP.
With ``align_pushes=True`` no worker pushes a step before every worker's values of the last step have landed,
and the weights are still DDP's."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
from tests.lightning_utils import TinyRegressor, fit_weights

pytestmark = pytest.mark.slow

# 8 kB buckets (the first too: a cap under 1 MiB sets it) over 2532 floats = 10 kB: 3 buckets, 2 shards
BUCKET_CAP_MB = 4096 / 2**20
STEPS_PER_EPOCH = 4  # fit_weights: 64 samples, 8 per device on 2 devices


class DeepRegressor(TinyRegressor):
    """Four layers in three buckets: shard 0 (the first 1266 floats) holds the first layer and most of the second,
    shard 1 the rest, so the first forward needs shard 0 alone; with replies per bucket each bucket is split over
    both shards, and the first forward needs the last bucket alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
        )


class _Timeline(pl.Callback):
    """Writes each rank's overlap timeline to ``<dir>/rank<r>.json`` at the fit's end."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ParameterServerStrategy) and strategy.overlap is not None
        push = strategy.overlap.push
        steps = [
            {**vars(t), "pull_arrived": list(t.pull_arrived.values()), "pull_landed": list(t.pull_landed.values())}
            for t in push.timeline
        ]
        params_bytes = sum(p.numel() * p.element_size() for p in push.client.params)
        record = {
            "buckets": len(push.buckets),
            "params_bytes": params_bytes,
            "global_step": trainer.global_step,
            "aligned": strategy.is_aligned,
            "replies_per_bucket": strategy.replies_per_bucket,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({**record, "steps": steps}))


def ps(**options: Any) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30), **options)


def ddp(model: pl.LightningModule, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    return fit_weights(DDPStrategy(start_method="fork"), 2, model=model, **trainer_kwargs)


def assert_ddp_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    # P=2: the shard computes g0/2 + g1/2 as DDP's reducer does (halving is exact, a two-term sum is
    # order-free), whichever bucket a gradient travelled in: bit-identical
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def _timelines(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("per_bucket", [None, True], ids=["one_reply_per_shard", "replies_per_bucket"])
def test_pushes_overlap_backward_and_pulls_overlap_the_next_forward(tmp_path: Path, per_bucket: bool | None) -> None:
    # on one node the default is one step and one reply per shard; True: each bucket split over both shards and
    # answered alone, its values landing per bucket
    strategy = ps(bucket_cap_mb=BUCKET_CAP_MB, reply_per_bucket=per_bucket)
    got = fit_weights(strategy, 2, model=DeepRegressor(), callbacks=[_Timeline(tmp_path)], max_steps=6)
    assert_ddp_weights(got, ddp(DeepRegressor()))
    for rank, record in enumerate(_timelines(tmp_path)):
        assert record["replies_per_bucket"] is bool(per_bucket), record
        assert record["buckets"] >= 3, record
        steps = record["steps"]
        assert len(steps) == 6, steps
        for t in steps:
            # the first bucket left while backward was still producing the others
            assert t["first_push"] < t["backward_end"], (rank, t)
            # every tensor has a gradient, so every bucket filled (and left) during backward
            assert t["bytes_before_backward_end"] == t["bytes_pushed"] == record["params_bytes"], (rank, t)
            # values land per shard, or per bucket with replies per bucket
            assert len(t["pull_landed"]) == (record["buckets"] if per_bucket else 2), (rank, t)
        for i, t in enumerate(steps[:-1]):  # the last step's values land at the fit's end: no next forward
            if (i + 1) % STEPS_PER_EPOCH == 0:  # an epoch's last step lands its values in the optimizer step
                assert t["next_forward"] is None, (rank, i, t)
                continue
            # the first layer's forward started on its own bucket's values while the others were not yet written in
            assert t["next_forward"] is not None and t["next_forward"] < max(t["pull_landed"]), (rank, i, t)


def test_accumulation_pushes_only_on_the_stepping_micro_batch(tmp_path: Path) -> None:
    options = {"accumulate_grad_batches": 2, "max_steps": 3}
    got = fit_weights(
        ps(bucket_cap_mb=BUCKET_CAP_MB), 2, model=DeepRegressor(), callbacks=[_Timeline(tmp_path)], **options
    )
    assert_ddp_weights(got, ddp(DeepRegressor(), **options))
    for record in _timelines(tmp_path):
        # one push of every slice per optimizer step: none on the accumulating micro-batches (a bucket
        # pushed there would be pushed twice in a step and fail the fit)
        assert record["global_step"] == 3
        assert [t["bytes_pushed"] for t in record["steps"]] == [record["params_bytes"]] * 3


def test_replies_per_bucket_with_accumulation_and_adam_equal_ddp(tmp_path: Path) -> None:
    # Adam's per-tensor state (a step count, two moments) stepped bucket by bucket, over accumulated micro-batches
    options = {"accumulate_grad_batches": 2, "max_steps": 3}
    strategy = ps(bucket_cap_mb=BUCKET_CAP_MB, reply_per_bucket=True)
    got = fit_weights(strategy, 2, model=AdamRegressor(), callbacks=[_Timeline(tmp_path)], **options)
    assert_ddp_weights(got, ddp(AdamRegressor(), **options))
    assert [r["replies_per_bucket"] for r in _timelines(tmp_path)] == [True, True]


def test_without_overlap_equals_ddp() -> None:
    strategy = ps(overlap=False)
    got = fit_weights(strategy, 2, model=DeepRegressor())
    assert_ddp_weights(got, ddp(DeepRegressor()))


class AdamRegressor(DeepRegressor):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class LateSecondRank(DeepRegressor):
    """Rank 1 starts every step's forward 50 ms late, so its values of the last step land that much after rank 0's:
    unaligned, rank 0 pushes the next step before them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class _Aligned(pl.Callback):
    """Writes each rank's ``is_aligned`` at the fit's start to ``<dir>/aligned<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ParameterServerStrategy)
        (self.out / f"aligned{trainer.global_rank}.json").write_text(json.dumps(strategy.is_aligned))


def test_aligned_pushes_wait_for_every_workers_values_and_equal_ddp(tmp_path: Path) -> None:
    got = fit_weights(
        ps(bucket_cap_mb=BUCKET_CAP_MB, align_pushes=True),
        2,
        model=LateSecondRank(),
        callbacks=[_Timeline(tmp_path)],
        max_steps=6,
    )
    assert_ddp_weights(got, ddp(DeepRegressor()))
    records = _timelines(tmp_path)
    assert all(r["aligned"] for r in records), records
    for k in range(1, 6):
        # every worker's values of step k - 1 landed (rank 1's ~50 ms after rank 0's) before any push of step k
        landed = max(max(r["steps"][k - 1]["pull_landed"]) for r in records)
        for rank, r in enumerate(records):
            t = r["steps"][k]
            assert t["aligned"] is not None and landed <= t["aligned"] <= t["first_push"], (rank, k, landed, t)


def test_aligned_without_overlap_equals_ddp(tmp_path: Path) -> None:
    got = fit_weights(ps(overlap=False, align_pushes=True), 2, model=DeepRegressor(), callbacks=[_Aligned(tmp_path)])
    assert_ddp_weights(got, ddp(DeepRegressor()))
    assert [json.loads((tmp_path / f"aligned{r}.json").read_text()) for r in range(2)] == [True, True]
