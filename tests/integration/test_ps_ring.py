"""``Trainer(strategy="ps_ring")`` against ``strategy="ddp"`` on 2 and 3 fork-started CPU processes: the same
final weights (SGD with momentum, AdamW with two param groups, overlapped or not, clipping by norm and by value,
accumulation, an LR warmup, BatchNorm buffers), checkpoints that resume exactly and hold DDP's optimizer state,
the per-step logs, that the pushes overlap backward, and the errors for what the shards cannot run."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_strategies  # noqa: F401  (registers "ps_ring")
from lightning_strategies import RingParameterServerStrategy
from tests.lightning_utils import (
    ManualRegressor,
    SaveAtEnd,
    TinyRegressor,
    WarmupRegressor,
    ddp_reference_weights,
    fit_weights,
    global_loader,
    steps_trainer,
)

pytestmark = pytest.mark.slow

# the shared helpers (tests/lightning_utils.py) under this file's short names
_trainer, _loader, _SaveAtEnd, _Manual = steps_trainer, global_loader, SaveAtEnd, ManualRegressor


def adamw_two_groups(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    ps = list(params)
    return torch.optim.AdamW(
        [{"params": ps[:2], "lr": 0.01}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.0}], weight_decay=0.1
    )


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


OPTIMIZERS = {"sgd_momentum": sgd, "adamw": adamw_two_groups}


def ps_ring(**kwargs: Any) -> RingParameterServerStrategy:
    return RingParameterServerStrategy(start_method="fork", timeout=timedelta(seconds=30), **kwargs)


def ddp_weights(
    devices: int, optimizer: str, accumulate: int = 1, clip: tuple[tuple[str, Any], ...] = ()
) -> dict[str, torch.Tensor]:
    return ddp_reference_weights(devices, OPTIMIZERS[optimizer], accumulate, clip)


def assert_weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def tolerance(devices: int) -> float:
    # P=2: the ring's reduce-scatter halves g0 + g1, DDP's gloo all-reduce sums the halves: the same float (halving
    # is exact), and each shard's update is the optimizer's own elementwise arithmetic: bit-identical. P=3: the
    # ring adds the three thirds in another order per chunk than gloo, ~1 ulp of the gradient per step; over 6
    # steps with weights of O(1), far below 1e-6.
    return 0.0 if devices == 2 else 1e-6


# TinyRegressor's 4 tensors: 1 bucket at the default cap; 1e-4 MiB (~26 floats) puts each in its own bucket. Each
# optimizer and each way of pushing at 2 and at 3 processes (6 fits, not the 12 of every combination: CI's time)
PARITY = [
    (2, "sgd_momentum", True, 25.0), (2, "adamw", True, 1e-4), (2, "sgd_momentum", False, 25.0),
    (3, "sgd_momentum", True, 1e-4), (3, "adamw", True, 25.0), (3, "adamw", False, 25.0),
]  # fmt: skip


@pytest.mark.parametrize(("devices", "optimizer", "overlap", "cap_mb"), PARITY)
def test_ps_ring_ends_with_ddp_weights(devices: int, optimizer: str, overlap: bool, cap_mb: float) -> None:
    model = TinyRegressor(optimizer_factory=OPTIMIZERS[optimizer])
    got = fit_weights(ps_ring(overlap=overlap, bucket_cap_mb=cap_mb), devices, model=model)
    assert_weights_equal(got, ddp_weights(devices, optimizer), tolerance(devices))


# TinyRegressor's averaged gradient has a norm of 0.50-0.83 and largest elements of 0.12-0.17 in these 6 steps
# (test_ps_fit.py): each setting clips at every step
CLIPPING = {
    "norm": (("gradient_clip_val", 0.05),),
    "value": (("gradient_clip_val", 0.01), ("gradient_clip_algorithm", "value")),
}


@pytest.mark.parametrize("setting", sorted(CLIPPING))
def test_clipping_ends_with_ddps_clipped_weights(setting: str) -> None:
    clip = CLIPPING[setting]
    got = fit_weights(ps_ring(bucket_cap_mb=1e-4), 2, **dict(clip))
    want = ddp_weights(2, "sgd_momentum", clip=clip)
    # by value: elementwise on the same averaged gradient, bit-identical; by norm: the shards sum the squared
    # norms of their chunks in float64, torch takes the float32 norm of the tensors' norms: ~1 ulp of the norm
    assert_weights_equal(got, want, 0.0 if setting == "value" else 1e-6)
    unclipped = ddp_weights(2, "sgd_momentum")
    assert any(not torch.allclose(got[k], unclipped[k], rtol=0, atol=1e-5) for k in want)


def test_one_process_equals_a_single_device() -> None:
    # one rank owns every chunk: the halves move nothing, the shard steps everything, bit for bit
    got = fit_weights(ps_ring(), 1, batch_size=16)
    assert_weights_equal(got, fit_weights("auto", 1, batch_size=16), 0.0)


def test_registered_name_and_accumulation_match_ddp() -> None:
    # the accumulated gradient is pushed on the stepping micro-batch only, as DDP syncs it
    got = fit_weights("ps_ring_fork", 2, accumulate_grad_batches=2)
    assert_weights_equal(got, ddp_weights(2, "sgd_momentum", accumulate=2), 0.0)


def test_lr_warmup_and_batchnorm_buffers_match_ddp() -> None:
    got = fit_weights(ps_ring(), 2, model=WarmupRegressor())
    assert_weights_equal(got, fit_weights(DDPStrategy(start_method="fork"), 2, model=WarmupRegressor()), 0.0)
    assert not torch.equal(got["net.0.weight"], ddp_weights(2, "sgd_momentum")["net.0.weight"])
    # BatchNorm: rank 0's running statistics broadcast before each forward, as DDP does (state_dict: rank 0's)
    got = fit_weights(ps_ring(), 2, model=TinyRegressor(batchnorm=True))
    want = fit_weights(DDPStrategy(start_method="fork"), 2, model=TinyRegressor(batchnorm=True))
    assert_weights_equal(got, want, 0.0)


class _Record(pl.Callback):
    """Each step's logged metrics and the shards' step times, summarised into ``callback_metrics`` at the end
    (what a fork-started fit brings back to the parent: rank 0's)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.times: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        last = trainer.strategy.shards.last  # type: ignore[attr-defined]
        assert last.first_push is not None and last.backward_end is not None
        self.times.append((last.first_push, last.backward_end, last.overlap_share))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = {
            "steps": len(self.rows),
            "sent_min": min(r["comm/bytes_sent"] for r in self.rows),
            "sent_max": max(r["comm/bytes_sent"] for r in self.rows),
            "received_max": max(r["comm/bytes_received"] for r in self.rows),
            "wait_max": max(r["ps/wait_seconds"] for r in self.rows),
            "pushed_in_backward": sum(first < end for first, end, _ in self.times),
            "share_min": min(share for _, _, share in self.times),
            "share_max": max(share for _, _, share in self.times),
        }
        trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in summary.items()})


@pytest.mark.parametrize("overlap", [True, False])
def test_logs_and_overlap(overlap: bool) -> None:
    trainer = _trainer(ps_ring(overlap=overlap, bucket_cap_mb=1e-4), 2, 4, log_every_n_steps=1, callbacks=[_Record()])
    trainer.fit(TinyRegressor(), _loader())
    got = {k: float(v) for k, v in trainer.callback_metrics.items()}
    n_bytes = 4 * sum(p.numel() for p in TinyRegressor().parameters())  # 212 floats
    assert got["steps"] == 4
    # per bucket, the reduce-scatter sends the half this rank does not own and the all-gather the owned half
    # (P = 2): the model's bytes each way, as ddp's all-reduce
    assert got["sent_min"] == got["sent_max"] == got["received_max"] == n_bytes
    assert 0.0 <= got["wait_max"] < 30.0
    if overlap:  # every bucket was queued from inside backward, the first before it ended
        assert got["pushed_in_backward"] == 4 and got["share_min"] == got["share_max"] == 1.0
    else:  # every bucket at the optimizer step
        assert got["pushed_in_backward"] == 0 and got["share_min"] == got["share_max"] == 0.0
    assert got["ps/overlap_share"] == (1.0 if overlap else 0.0)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_checkpoint_resumes_exactly_and_holds_ddps_state(tmp_path: Path, optimizer: str) -> None:
    # whole epochs (4 steps of global batch 16 over 64 samples), as test_ps_fit.py
    def model() -> TinyRegressor:
        return TinyRegressor(optimizer_factory=OPTIMIZERS[optimizer])

    full = model()
    _trainer(ps_ring(bucket_cap_mb=1e-4), 2, -1, max_epochs=2).fit(full, _loader())
    ckpt = tmp_path / "half.ckpt"
    _trainer(ps_ring(bucket_cap_mb=1e-4), 2, -1, max_epochs=1, callbacks=[_SaveAtEnd(ckpt)]).fit(model(), _loader())
    resumed = model()
    _trainer(ps_ring(bucket_cap_mb=1e-4), 2, -1, max_epochs=2).fit(resumed, _loader(), ckpt_path=ckpt)
    assert_weights_equal(resumed.state_dict(), full.state_dict(), 0.0)

    # the file holds every tensor's whole state, equal to DDP's at the same step, and loads on one device
    ddp_ckpt = tmp_path / "ddp.ckpt"
    ddp = DDPStrategy(start_method="fork")
    _trainer(ddp, 2, -1, max_epochs=1, callbacks=[_SaveAtEnd(ddp_ckpt)]).fit(model(), _loader())
    got = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    want = torch.load(ddp_ckpt, weights_only=False)["optimizer_states"][0]
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
    for i in range(4):
        assert sorted(got["state"][i]) == sorted(want["state"][i])
        for key, value in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=0, atol=0)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    single = model()
    single.configure_optimizers().load_state_dict(got)


def test_a_ddp_checkpoint_resumes_under_ps_ring(tmp_path: Path) -> None:
    ckpt = tmp_path / "ddp.ckpt"
    ddp = DDPStrategy(start_method="fork")
    _trainer(ddp, 2, -1, max_epochs=1, callbacks=[_SaveAtEnd(ckpt)]).fit(TinyRegressor(), _loader())
    resumed = TinyRegressor()
    _trainer(ps_ring(), 2, -1, max_epochs=2).fit(resumed, _loader(), ckpt_path=ckpt)
    full = TinyRegressor()
    _trainer(DDPStrategy(start_method="fork"), 2, -1, max_epochs=2).fit(full, _loader())
    assert_weights_equal(resumed.state_dict(), full.state_dict(), 0.0)  # DDP's momentum went to the shards


class _Unused(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(2, 2)  # trainable, in the optimizer, never used


def _lamb(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    from lightning_strategies.optim import Lamb

    return Lamb(params, lr=0.02)


def _fp16() -> dict[str, Any]:
    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "message"),
    [
        (_Manual, dict, r"found `automatic_optimization = False`"),
        (lambda: TinyRegressor(optimizer_factory=_lamb), dict, r"found Lamb, which is not an elementwise optimizer"),
        # on CPU Lightning turns "16-mixed" into bf16: a GradScaler comes as a plugin (test_ps_amp.py)
        (TinyRegressor, _fp16, r"found precision='16-mixed' \(a GradScaler\)"),
        (_Unused, dict, r"trainable tensor\(s\) \[4, 5\] \(optimizer order\) have no gradient at the optimizer step"),
    ],
)
def test_unsupported_setups_raise_clear_errors(model: Any, trainer_kwargs: Any, message: str) -> None:
    with pytest.raises(Exception, match=message):
        fit_weights(ps_ring(), 2, model=model(), **trainer_kwargs())


def test_bad_bucket_cap_and_ddp_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"bucket_cap_mb=0\): expected a positive bucket size"):
        RingParameterServerStrategy(bucket_cap_mb=0)
    with pytest.raises(TypeError, match="find_unused_parameters"):
        RingParameterServerStrategy(find_unused_parameters=True)
