"""``Trainer(strategy="ps")`` against ``strategy="ddp"`` on 2 and 3 fork-started CPU processes:
same final weights, checkpoints that resume exactly and load on one device, accumulation,
the per-step communication logs, and the errors for what the strategy does not support."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_strategies  # noqa: F401  (registers "ps")
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
from tests.lightning_utils import (
    ManualRegressor,
    SaveAtEnd,
    TinyRegressor,
    WarmupRegressor,
    ddp_reference_weights,
    fit_weights,
    global_loader,
    sgd_momentum,
    steps_trainer,
)

pytestmark = pytest.mark.slow

# the shared helpers (tests/lightning_utils.py) under this file's short names
_trainer, _loader, _SaveAtEnd, _Manual = steps_trainer, global_loader, SaveAtEnd, ManualRegressor


def lamb(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    from lightning_strategies.optim import Lamb

    return Lamb(params, lr=0.02, weight_decay=0.01)


def lamb_max_grad_norm(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    from lightning_strategies.optim import Lamb

    return Lamb(params, lr=0.02, weight_decay=0.01, max_grad_norm=0.05)


OPTIMIZERS = {"sgd_momentum": sgd_momentum, "lamb": lamb, "lamb_max_grad_norm": lamb_max_grad_norm}


def ps(num_servers: int | None = None) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", num_servers=num_servers, timeout=timedelta(seconds=30))


def ddp_weights(
    devices: int, optimizer: str, accumulate: int = 1, clip: tuple[tuple[str, Any], ...] = ()
) -> dict[str, torch.Tensor]:
    return ddp_reference_weights(devices, OPTIMIZERS[optimizer], accumulate, clip)


def assert_weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], devices: int) -> None:
    assert got.keys() == want.keys()
    # P=2: the shard computes g0/2 + g1/2 like DDP's reducer (halving is exact, a 2-term sum is
    # order-free), so the weights are bit-identical. P=3: gloo's ring adds the three thirds in a
    # different order per chunk than the shard does, a rounding difference of ~1 ulp of the
    # gradient per step; over 6 steps, with weights of O(1), that stays far below 1e-6.
    atol = 0.0 if devices == 2 else 1e-6
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "lamb"])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("num_servers", [None, 1])
def test_ps_ends_with_ddp_weights(devices: int, optimizer: str, num_servers: int | None) -> None:
    got = fit_weights(ps(num_servers), devices, model=TinyRegressor(optimizer_factory=OPTIMIZERS[optimizer]))
    assert_weights_equal(got, ddp_weights(devices, optimizer), devices)


# TinyRegressor's averaged gradient has a norm of 0.50-0.83 and largest elements of 0.12-0.17 in these 6 steps
# (measured on one device): each setting clips (or pre-normalises) at every step
CLIPPING = {
    "norm": ("sgd_momentum", (("gradient_clip_val", 0.05),)),
    "value": ("sgd_momentum", (("gradient_clip_val", 0.01), ("gradient_clip_algorithm", "value"))),
    "lamb_max_grad_norm": ("lamb_max_grad_norm", ()),
    "norm_then_lamb_max_grad_norm": ("lamb_max_grad_norm", (("gradient_clip_val", 0.1),)),
}


@pytest.mark.parametrize("setting", sorted(CLIPPING))
def test_ps_clipping_over_two_shards_ends_with_ddps_clipped_weights(setting: str) -> None:
    optimizer, clip = CLIPPING[setting]
    got = fit_weights(ps(), 2, model=TinyRegressor(optimizer_factory=OPTIMIZERS[optimizer]), **dict(clip))
    want = ddp_weights(2, optimizer, clip=clip)
    # By value: elementwise on the same averaged gradient, bit-identical. By norm: the shards sum the squared
    # float32 norms of their tensors in float64, torch takes the float32 norm of those norms: the global norm
    # differs by ~1 ulp (1e-7 relative), the weights after 6 steps of O(0.01) by far less than 1e-6.
    atol = 0.0 if setting == "value" else 1e-6
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    # and the clipping did act (the weights are not the unclipped run's)
    unclipped = ddp_weights(2, "lamb" if optimizer == "lamb_max_grad_norm" else optimizer)
    assert any(not torch.allclose(got[k], unclipped[k], rtol=0, atol=1e-5) for k in want)


def test_one_process_equals_a_single_device() -> None:
    got = fit_weights(ps(), 1, batch_size=16)
    want = fit_weights("auto", 1, batch_size=16)
    assert_weights_equal(got, want, 2)  # one worker: no averaging at all, bit-identical


def test_registered_name_trains_like_ddp() -> None:
    # "ps" itself starts ranks with popen, which re-runs pytest; "ps_fork" is the same row forked
    got = fit_weights("ps_fork", 2)
    assert_weights_equal(got, ddp_weights(2, "sgd_momentum"), 2)


def test_gradient_accumulation_matches_ddp() -> None:
    # the accumulated local gradient is pushed at the optimizer step, as DDP syncs it at the last
    # micro-batch: same average, same step
    got = fit_weights(ps(), 2, accumulate_grad_batches=2)
    assert_weights_equal(got, ddp_weights(2, "sgd_momentum", accumulate=2), 2)


def test_lr_scheduler_warmup_matches_ddp() -> None:
    got = fit_weights(ps(), 2, model=WarmupRegressor())
    want = fit_weights(DDPStrategy(start_method="fork"), 2, model=WarmupRegressor())
    assert_weights_equal(got, want, 2)
    # and the warmup did change the result: the servers did not keep the initial lr
    assert not torch.equal(got["net.0.weight"], ddp_weights(2, "sgd_momentum")["net.0.weight"])


class _BatchNormRegressor(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
        self.spread = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # before the forward every rank must hold rank 0's running statistics, as under DDP
        stats = self.all_gather(self.net[1].running_mean.clone())
        self.spread = max(self.spread, float((stats.max(0).values - stats.min(0).values).max()))
        self.log("synced", float(self.global_rank + 1), sync_dist=True, reduce_fx="sum")
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        self.trainer.callback_metrics["buffer_spread"] = torch.tensor(self.spread)
        # Lightning's own collectives still run on the process group
        strategy = self.trainer.strategy
        strategy.barrier()
        self.trainer.callback_metrics["broadcast"] = torch.tensor(float(strategy.broadcast(self.global_rank + 7)))
        ranks = torch.tensor(float(self.global_rank + 1))
        self.trainer.callback_metrics["reduced"] = strategy.reduce(ranks, reduce_op="sum")


def test_buffers_follow_rank0_like_ddp() -> None:
    trainer = _trainer(ps(), 2, max_steps=4)
    trainer.fit(_BatchNormRegressor(), _loader())
    assert float(trainer.callback_metrics["buffer_spread"]) == 0.0
    assert float(trainer.callback_metrics["broadcast"]) == 7.0  # rank 0's value
    assert float(trainer.callback_metrics["reduced"]) == float(trainer.callback_metrics["synced"]) == 3.0
    got = fit_weights(ps(), 2, model=_BatchNormRegressor())
    want = fit_weights(DDPStrategy(start_method="fork"), 2, model=_BatchNormRegressor())
    assert_weights_equal(got, want, 2)  # weights and buffers (rank 0's state_dict)


class _Metrics(pl.Callback):
    """Keeps what the strategy logged each step (rank 0's is returned to the parent)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@pytest.mark.parametrize("log_every_n_steps", [1, 2])
def test_logs_bytes_and_wait_per_step(log_every_n_steps: int) -> None:
    trainer = _trainer(ps(), 2, max_steps=4, log_every_n_steps=log_every_n_steps)
    start = time.perf_counter()
    trainer.fit(TinyRegressor(), _loader())
    fit_seconds = time.perf_counter() - start
    metrics = trainer.callback_metrics
    n_bytes = 4 * sum(p.numel() for p in TinyRegressor().parameters())  # 212 floats
    # per step (a mean over the steps since the last log when logging every n steps)
    assert float(metrics["comm/bytes_sent"]) == float(metrics["comm/bytes_received"]) == n_bytes
    # two shards: the cut at 212/2 = 106 floats moves to net.0.weight's end (cuts inside a tensor
    # fall on multiples of 64 elements), so 128 floats and 84; the busiest takes 128 floats from
    # each of 2 workers and sends them back to each
    assert float(metrics["ps/server_bytes_max"]) == 2 * 2 * 128 * 4
    # the window's mean per step of the waits in the sync barrier: each wait lies inside the fit
    # (measured here, processes' start included; the old bound, 30 s, was the RPC timeout)
    assert 0.0 < float(metrics["ps/wait_seconds"]) < fit_seconds
    assert "train_loss" in metrics


def test_checkpoint_resume_restores_the_servers_optimizer_state(tmp_path: Path) -> None:
    # whole epochs (4 steps of global batch 16 over 64 samples): Lightning replays the data of a
    # run resumed under max_steps differently even on one device, under max_epochs exactly
    full_model = TinyRegressor()
    _trainer(ps(), 2, max_steps=-1, max_epochs=2).fit(full_model, _loader())
    ckpt = tmp_path / "half.ckpt"
    _trainer(ps(), 2, max_steps=-1, max_epochs=1, callbacks=[_SaveAtEnd(ckpt)]).fit(TinyRegressor(), _loader())
    resumed_model = TinyRegressor()
    _trainer(ps(), 2, max_steps=-1, max_epochs=2).fit(resumed_model, _loader(), ckpt_path=ckpt)
    # momentum restored to the shards: the resumed run is bit-identical to the uninterrupted one
    assert_weights_equal(resumed_model.state_dict(), full_model.state_dict(), 2)

    # the file holds the gathered momentum of every tensor, equal to DDP's at the same step
    state = torch.load(ckpt, weights_only=False)
    ddp_ckpt = tmp_path / "ddp.ckpt"
    _trainer(DDPStrategy(start_method="fork"), 2, max_steps=-1, max_epochs=1, callbacks=[_SaveAtEnd(ddp_ckpt)]).fit(
        TinyRegressor(), _loader()
    )
    ddp_state = torch.load(ddp_ckpt, weights_only=False)
    ps_opt, ddp_opt = state["optimizer_states"][0], ddp_state["optimizer_states"][0]
    assert sorted(ps_opt["state"]) == [0, 1, 2, 3]
    for i in range(4):
        torch.testing.assert_close(
            ps_opt["state"][i]["momentum_buffer"], ddp_opt["state"][i]["momentum_buffer"], rtol=0, atol=0
        )
    assert [g["params"] for g in ps_opt["param_groups"]] == [[0, 1, 2, 3]]


def test_ps_checkpoint_loads_into_a_single_device_model(tmp_path: Path) -> None:
    ckpt = tmp_path / "ps.ckpt"
    _trainer(ps(), 2, max_steps=3, callbacks=[_SaveAtEnd(ckpt)]).fit(TinyRegressor(), _loader())
    state = torch.load(ckpt, weights_only=False)
    model = TinyRegressor()
    model.load_state_dict(state["state_dict"])  # plain keys, no "module." prefix
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(state["optimizer_states"][0])
    assert len(optimizer.state) == 4


class _TwoOptimizers(TinyRegressor):
    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.SGD(self.net[2].parameters(), lr=0.1),
        ]


class _NeedsModel(torch.optim.SGD):
    def __init__(self, params: Any, model: nn.Module) -> None:
        super().__init__(params, lr=0.1)
        self.model = model


class _Unrebuildable(TinyRegressor):
    def configure_optimizers(self) -> Any:
        return _NeedsModel(self.parameters(), self)


class _OwnClipping(TinyRegressor):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


@pytest.mark.parametrize(
    ("strategy", "model", "trainer_kwargs", "message"),
    [
        (
            lambda: ps(num_servers=3),
            TinyRegressor,
            {},
            r"num_servers=3\) with 2 processes: expected 1 <= num_servers <= 2",
        ),
        (ps, _Manual, {}, r"found `automatic_optimization = False`"),
        (
            ps,
            _TwoOptimizers,
            {},
            r"(multiple optimizers is only supported with manual optimization|found 2 optimizers)",
        ),
        (ps, _Unrebuildable, {}, r"could not rebuild the optimizer on a server: found _NeedsModel"),
        (ps, _OwnClipping, {}, r"found _OwnClipping.configure_gradient_clipping overridden: expected Lightning's"),
    ],
)
def test_unsupported_setups_raise_clear_errors(
    strategy: Any, model: Any, trainer_kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception, match=message):
        fit_weights(strategy(), 2, model=model(), **trainer_kwargs)


class _DiesOnRank1(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 crashed in training_step")
        return super().training_step(batch, batch_idx)


def test_a_crashing_rank_fails_the_fit_without_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1 crashed in training_step"):
        fit_weights(ps(), 2, model=_DiesOnRank1())
    # the launcher reports the crash and stops the survivor: well inside the 30 s barrier timeout
    assert time.monotonic() - start < 25
