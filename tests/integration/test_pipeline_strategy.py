"""PipelineStrategy on fork-started gloo processes, held to the unsplit model.

Tolerances: a pipeline computes the same float32 operations as the unsplit model, except that
the batch's mean loss becomes the sum of per-micro-batch means x 1/M, which re-associates the
sums of the loss and of every weight gradient. With O(1) values that moves results by a few
ulps (~1e-7) per step; after a handful of SGD steps the drift stays below ~1e-6, so weights are
compared with ``atol=1e-5, rtol=1e-4`` (a wrong gradient, e.g. one micro-batch or one stage
missing, moves them by >1e-2).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import regression_data
from torch import nn
from torch.utils.data import DataLoader

import lightning_strategies  # noqa: F401
from lightning_strategies.comm.pipeline import PipelineRuntime
from lightning_strategies.strategies.pipeline import PipelineStrategy

pytestmark = pytest.mark.slow

ATOL, RTOL = 1e-5, 1e-4


def deep_net() -> nn.Sequential:
    """Six blocks, no batch norm (so micro-batching changes nothing)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


class PipeRegressor(pl.LightningModule):
    """Written the plain way (loss from ``self(x)``), plus the two pipeline methods."""

    def __init__(self, momentum: float = 0.9, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.net = deep_net()
        self.momentum, self.weight_decay = momentum, weight_decay
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=self.momentum, weight_decay=self.weight_decay)


def fit(
    strategy: Any,
    devices: int,
    *,
    max_steps: int = 4,
    batch_size: int = 16,
    model: pl.LightningModule | None = None,
    distributed_sampler: bool = False,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], pl.Trainer]:
    """Fit on the 64 regression samples in order (no shuffling: the same batches everywhere)."""
    model = model if model is not None else PipeRegressor()
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=distributed_sampler,
        log_every_n_steps=1,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(regression_data(), batch_size=batch_size), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer


def assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL, msg=lambda m, k=k: f"{k}: {m}")


# -- the runtime alone: loss and gradients step by step ------------------------------------------


def _runtime_steps(rank: int, world: int, schedule: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = deep_net()
    runtime = PipelineRuntime(
        net,
        counts=[2, 2, 2] if world == 3 else [3, 3],
        schedule=schedule,
        microbatches=4,
        loss_fn=nn.functional.mse_loss,
        group=dist.group.WORLD,
        device=torch.device("cpu"),
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = regression_data()
    losses, grads = [], {}
    for step in range(steps):
        x, y = data.tensors[0][16 * step : 16 * (step + 1)], data.tensors[1][16 * step : 16 * (step + 1)]
        optimizer.zero_grad()
        loss = runtime.step(x, y)
        losses.append(None if loss is None else float(loss))
        # plain lists: tensors would travel through shared memory that dies with the worker
        grads = {n: p.grad.tolist() for n, p in net.named_parameters() if p.grad is not None}
        optimizer.step()
    return {"losses": losses, "grads": grads}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_loss_and_gradients_equal_the_unsplit_model(schedule: str, world: int) -> None:
    steps = 3
    results = run_workers(_runtime_steps, world, schedule, steps, timeout=60)
    net = deep_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = regression_data()
    ref_losses = []
    for step in range(steps):
        x, y = data.tensors[0][16 * step : 16 * (step + 1)], data.tensors[1][16 * step : 16 * (step + 1)]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        ref_losses.append(float(loss))
        optimizer.step()
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert all(loss is None for r in results[:-1] for loss in r["losses"])
    seen: set[str] = set()
    for r in results:
        for name, grad in r["grads"].items():
            ref_grad = dict(net.named_parameters())[name].grad
            torch.testing.assert_close(torch.tensor(grad), ref_grad, atol=1e-6, rtol=1e-5)
            seen.add(name)
    assert seen == {n for n, _ in net.named_parameters()}  # every stage's gradients, each on one rank


LOSS_SLEEP_S = 0.02


def _timed_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    time.sleep(LOSS_SLEEP_S)  # the last stage's loss, made long enough to see
    return nn.functional.mse_loss(outputs, targets)


def _timeline(rank: int, world: int, schedule: str) -> dict[str, Any]:
    torch.manual_seed(0)
    runtime = PipelineRuntime(
        deep_net(), counts=[3, 3], schedule=schedule, microbatches=4, loss_fn=_timed_loss,
        group=dist.group.WORLD, device=torch.device("cpu"),
    )  # fmt: skip
    runtime.record_events(True)
    data = regression_data()
    runtime.step(data.tensors[0][:16], data.tensors[1][:16])
    return {"events": runtime.events(), "busy": runtime.stage_seconds(), "wall": runtime.last_step_seconds}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_last_stage_loss_counts_as_compute(schedule: str) -> None:
    """The loss the schedule computes between chunks is the last stage's work, not its idle time."""
    first, last = run_workers(_timeline, 2, schedule, timeout=60)
    assert [e[1] for e in first["events"]].count("L") == 0
    kinds = [(e[1], e[2]) for e in last["events"]]
    assert sorted(mb for kind, mb in kinds if kind == "L") == [0, 1, 2, 3]
    for mb in range(4):  # each micro-batch's loss after its forward, before its backward
        assert kinds.index(("F", mb)) < kinds.index(("L", mb)) < kinds.index(("B", mb))
    loss_seconds = [e[4] - e[3] for e in last["events"] if e[1] == "L"]
    assert min(loss_seconds) >= LOSS_SLEEP_S
    # busy seconds are the recorded chunks, losses included, and fit in the step
    assert last["busy"][0] == pytest.approx(sum(e[4] - e[3] for e in last["events"]))
    assert 4 * LOSS_SLEEP_S <= last["busy"][0] <= last["wall"]


# -- Lightning fits ------------------------------------------------------------------------------


class _StepTimes(Callback):
    """Per rank and training batch: the batch's time (``on_train_batch_start`` to ``on_train_batch_end``,
    which encloses the runtime's step), the runtime's own step seconds, and its recorded chunks' span and
    busy seconds, read just before the strategy resets the runtime's timers; all-gathered every step,
    the last step's rows in ``callback_metrics["test/times"]``."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        runtime = trainer.strategy._runtime  # type: ignore[attr-defined]
        if runtime is not None and "reset_timers" not in vars(runtime):  # built by the first step
            runtime.record_events(True)
            reset = runtime.reset_timers

            def snapshot_then_reset() -> None:
                events = runtime.events()
                span = max(e[4] for e in events) - min(e[3] for e in events)
                self.step = [runtime.last_step_seconds, span, sum(e[4] - e[3] for e in events)]
                reset()

            runtime.reset_timers = snapshot_then_reset
        self.step: list[float] = []
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        values = [time.perf_counter() - self.start, *self.step] if self.step else [0.0] * 4
        row = torch.tensor(values, dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(trainer.world_size)]
        dist.all_gather(rows, row)
        self.rows = torch.stack(rows)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.callback_metrics["test/times"] = self.rows


@pytest.fixture(scope="module")
def single_device() -> dict[str, torch.Tensor]:
    return fit("auto", 1)[0]


@pytest.mark.parametrize(
    ("kwargs", "devices"),
    [
        ({"schedule": "gpipe"}, 2),
        ({"schedule": "1f1b"}, 2),
        ({"schedule": "1f1b", "microbatches": 4}, 3),
        ({"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 4}, 2),
        ({"schedule": "gpipe", "balance": "time"}, 2),
        ({"schedule": "1f1b", "balance": [1, 5]}, 2),
    ],
    ids=["gpipe", "1f1b", "1f1b-3stages", "interleaved", "balance-time", "balance-list"],
)
def test_fit_equals_single_device(kwargs: dict[str, Any], devices: int, single_device: dict[str, torch.Tensor]) -> None:
    weights, trainer = fit(PipelineStrategy(start_method="fork", **kwargs), devices, callbacks=[_StepTimes()])
    assert_weights_close(weights, single_device)
    metrics = trainer.callback_metrics
    # The last step's logs against the test's own clocks (float32 in the logs: rel 1e-5). Rank r's
    # stages are r, r + K, ...: their logged compute seconds are the chunks the runtime recorded.
    batch_seconds, wall, span, busy = metrics["test/times"].unbind(1)
    stages = devices * kwargs.get("stages_per_rank", 1)
    stage_seconds = [float(metrics[f"pipeline/stage_seconds/{s}"]) for s in range(stages)]
    assert [sum(stage_seconds[r::devices]) for r in range(devices)] == pytest.approx(busy.tolist(), rel=1e-5)
    # Each rank's step time holds its chunks and lies within the batch's hooks ...
    assert bool((span <= wall).all() and (wall <= batch_seconds).all()), metrics["test/times"]
    # ... and the bubble is the mean over ranks of the share of it not computing (0.78-0.94 here:
    # tiny stages, Python between chunks). A wrong formula (busy / wall, one rank's share) moves it by
    # > 0.05, another rank's busy or step time (stages 2x apart in compute) by > 1e-3.
    bubble = float(metrics["pipeline/bubble_fraction"])
    assert bubble == pytest.approx(float((1 - busy / wall).mean()), rel=1e-5)
    assert "train_loss" in metrics  # the module's own self.log, on the last stage's outputs


class MetaRegressor(PipeRegressor):
    """The same net, built in configure_model: on the meta device under the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.net is None:
            self.net = deep_net()  # seeds 0, then builds: under the pipeline nothing is drawn here


def test_model_built_in_configure_model_starts_from_the_unsplit_models_weights(
    single_device: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """Built on meta, rank 0 initialises each block at setup with reset_parameters() from its RNG
    (seeded 0 in configure_model, nothing drawn since): the unsplit model's weights, so the fit
    ends where one device's does (the tolerance of this file). The caller's module never built its
    net (configure_model ran in the ranks), so the trained weights are read from the checkpoint."""
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4)
    strategy = PipelineStrategy(start_method="fork")
    fit(strategy, 2, model=MetaRegressor(), callbacks=[callback], enable_checkpointing=True)
    assert_weights_close(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"], single_device)


def test_fit_with_clipping_accumulation_and_weight_decay_equals_single_device() -> None:
    """Global-norm clipping across stages; accumulation; decay must not touch other stages' weights."""
    kwargs: dict[str, Any] = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2, "max_steps": 2}
    ref, _ = fit("auto", 1, model=PipeRegressor(weight_decay=0.1), **kwargs)
    weights, _ = fit(PipelineStrategy(start_method="fork"), 2, model=PipeRegressor(weight_decay=0.1), **kwargs)
    assert_weights_close(weights, ref)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_replicas_x_two_stages_matches_ddp(accumulate: int, tmp_path: Path) -> None:
    """4 processes (2 replicas of a 2-stage pipeline) vs 2-process DDP, both with Lightning's sampler.

    With accumulation, replicas average once per optimizer step (as DDP under no_sync). The
    checkpoint holds the same full model and every stage's optimizer state.
    """
    ddp, _ = fit(
        DDPStrategy(start_method="fork"), 2, batch_size=8, distributed_sampler=True, accumulate_grad_batches=accumulate
    )
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=4 // accumulate)
    pp, _ = fit(
        PipelineStrategy(num_stages=2, start_method="fork"),
        4,
        batch_size=8,
        distributed_sampler=True,
        callbacks=[callback],
        enable_checkpointing=True,
        accumulate_grad_batches=accumulate,
    )
    assert_weights_close(pp, ddp)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert_weights_close(checkpoint["state_dict"], ddp)
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(list(PipeRegressor().parameters()))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_validation_uses_every_sample(schedule: str) -> None:
    """Eval batches that do not split into micro-batches are padded, not dropped: val_loss as on one device."""
    model = PipeRegressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    val = DataLoader(regression_data(n=30, seed=1), batch_size=7)
    ref = trainer.validate(model, val, verbose=False)[0]["val_loss"]
    pipe = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PipelineStrategy(schedule=schedule, start_method="fork"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    out = pipe.validate(PipeRegressor(), val, verbose=False)[0]["val_loss"]
    assert out == pytest.approx(ref, rel=1e-5)


class _CountForwards(Callback):
    """Counts every block's forward calls per training step on its rank; writes ``rank<r>.json`` at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.current: list[int] = []
        self.steps: list[list[int]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        blocks = pl_module.pipeline_layers()  # type: ignore[operator]
        self.current = [0] * len(blocks)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self._count(i))

    def _count(self, i: int) -> None:
        self.current[i] += 1

    def on_train_batch_start(self, *args: Any) -> None:
        self.current = [0] * len(self.current)

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(list(self.current))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_forward_of_every_block_per_micro_batch(schedule: str, tmp_path: Path) -> None:
    """A training step runs each block's forward once per micro-batch, on the one rank that holds it.

    The first step adds one forward per block: torch.distributed.pipelining infers each stage's
    shapes from the first micro-batch (``_initialize_pp_stages``: forked RNG, buffers restored
    after). A logging forward besides the step's would make these counts 2M (2M + 2 at first).
    """
    m, steps = 4, 3
    fit(
        PipelineStrategy(schedule=schedule, microbatches=m, start_method="fork"),
        2,
        max_steps=steps,
        callbacks=[_CountForwards(tmp_path)],
    )
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n_blocks = len(deep_net())
    for step in range(steps):
        expected = m + 1 if step == 0 else m
        for block in range(n_blocks):
            counts = sorted(rank[step][block] for rank in per_rank)
            assert counts == [0, expected], f"step {step}, block {block}: {per_rank}"


class DropoutBatchNormRegressor(PipeRegressor):
    """Batch norm on stage 0, dropout on stage 1 (with balance=[3, 3])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 4)
        )


def test_dropout_and_batch_norm_as_on_one_device() -> None:
    """With one micro-batch, one forward per step: the same dropout masks and batch-norm statistics.

    Each rank draws from the RNG state the fit starts with, and the only random draw of a step is
    stage 1's dropout, as on one device; the batch-norm running statistics must be updated once
    per step. A second, logging forward that drew its own masks, or updated the statistics, would
    move the weights or the buffers (``num_batches_tracked`` would count 8 instead of 4).
    """
    ref, ref_trainer = fit("auto", 1, model=DropoutBatchNormRegressor())
    strategy = PipelineStrategy(schedule="gpipe", microbatches=1, balance=[3, 3], start_method="fork")
    weights, trainer = fit(strategy, 2, model=DropoutBatchNormRegressor())
    assert int(weights["net.1.num_batches_tracked"]) == 4
    assert_weights_close(weights, ref)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(
        float(ref_trainer.callback_metrics["train_loss"]), rel=1e-5
    )


def _two_fits_in_one_process(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # the processes exist already: Lightning starts none
    before = len(dist.distributed_c10d._world.pg_map)
    after = []
    for _ in range(2):
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=PipelineStrategy(), max_steps=2, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=16))
        after.append(len(dist.distributed_c10d._world.pg_map))
    return {"before": before, "after": after, "initialized": dist.is_initialized()}


def test_teardown_destroys_the_groups_it_made_and_keeps_the_default() -> None:
    """After a fit only the default group is left (the mesh's groups, 2 per rank, are gone), and a
    second fit in the same process (as under torchrun) builds its mesh again and trains."""
    for result in run_workers(_two_fits_in_one_process, 2, timeout=120):
        assert result == {"before": 1, "after": [1, 1], "initialized": True}


def _fit_then_validate(rank: int, world: int) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)  # the processes exist already (as under torchrun)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=PipelineStrategy(), max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    model = PipeRegressor()
    trainer.fit(model, DataLoader(regression_data(), batch_size=16))
    held = sorted(k for k, v in model.state_dict().items() if not v.is_meta)
    result = trainer.validate(model, DataLoader(regression_data(n=30, seed=1), batch_size=6), verbose=False)
    return {"val_loss": result[0]["val_loss"], "held": held}


def test_validate_after_fit_in_the_same_processes_keeps_the_split(single_device: dict[str, torch.Tensor]) -> None:
    """Under torchrun a rank's module keeps its own stages after fit (the others stay meta), and a
    validate() of the same module in the same processes runs on that split: the validation loss
    of the fitted weights, as one device computes it (rel 1e-5: the tolerance of this file)."""
    results = run_workers(_fit_then_validate, 2, timeout=120)
    model = PipeRegressor()
    model.load_state_dict(single_device)
    x, y = regression_data(n=30, seed=1).tensors
    with torch.no_grad():
        want = float(nn.functional.mse_loss(model(x), y))
    assert results[0]["held"] == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert results[1]["held"] == ["net.4.bias", "net.4.weight", "net.5.bias", "net.5.weight"]
    for r in results:
        assert r["val_loss"] == pytest.approx(want, rel=1e-5)


# -- checkpoints -----------------------------------------------------------------------------------


def test_checkpoint_resumes_and_loads_into_a_single_device_model(tmp_path: Path) -> None:
    """1 epoch (4 steps) under a 2-stage pipeline, saved; loaded on one device, resumed to 2 epochs.

    The pipeline's checkpoint must equal the single device's (gathered weights and every stage's
    momentum buffers, indexed as on one device) and load with torch.load + load_state_dict into
    the unsplit module. Resumed on one device, and under 2 stages, it ends where one device's own
    save-and-resume ends (pipeline vs one device: the tolerance of this file; Lightning's resume
    is compared with itself, see docs/howto/resume.md on max_steps). Resumed under 3 stages
    with the same 4 micro-batches, it ends bit-identical to the 2-stage resume: each block
    computes the same micro-batches in the same order whatever the split. The other way round,
    one device's checkpoint resumes under 3 stages.
    """

    def save(strategy: Any, devices: int, name: str) -> dict[str, Any]:
        callback = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, every_n_epochs=1)
        fit(strategy, devices, max_steps=4, callbacks=[callback], enable_checkpointing=True)
        return torch.load(tmp_path / name / "last.ckpt", weights_only=False)

    def pipeline() -> PipelineStrategy:
        return PipelineStrategy(start_method="fork", microbatches=4)

    single_ckpt = save("auto", 1, "single")
    pipe_ckpt = save(pipeline(), 2, "pipe")
    assert_weights_close(pipe_ckpt["state_dict"], single_ckpt["state_dict"])
    single_state, pipe_state = single_ckpt["optimizer_states"][0]["state"], pipe_ckpt["optimizer_states"][0]["state"]
    assert pipe_state.keys() == single_state.keys()  # every stage's part, indexed as on one device
    for i in single_state:
        torch.testing.assert_close(pipe_state[i]["momentum_buffer"], single_state[i]["momentum_buffer"])

    ref, _ = fit("auto", 1, max_steps=8, ckpt_path=str(tmp_path / "single" / "last.ckpt"))
    pipe_path = str(tmp_path / "pipe" / "last.ckpt")
    single = PipeRegressor()
    single.load_state_dict(pipe_ckpt["state_dict"])  # the full model, loadable on one device
    assert_weights_close(fit("auto", 1, max_steps=8, model=single, ckpt_path=pipe_path)[0], ref)
    resumed, _ = fit(pipeline(), 2, max_steps=8, ckpt_path=pipe_path)
    assert_weights_close(resumed, ref)
    resplit, _ = fit(pipeline(), 3, max_steps=8, ckpt_path=pipe_path)  # another split of the same file
    for k, v in resumed.items():
        torch.testing.assert_close(resplit[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    single_path = str(tmp_path / "single" / "last.ckpt")
    assert_weights_close(fit(pipeline(), 3, max_steps=8, ckpt_path=single_path)[0], ref)


# -- a real model ------------------------------------------------------------------------------------


def test_resnet18_two_stages_learns_digits(tmp_path: Path) -> None:
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule
    from recipes.models import build_model

    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=64, image_size=16, num_workers=0)
    model = ClassificationModule(
        build_model("resnet18", num_classes=10, in_channels=1, width=16),
        num_classes=10,
        optimizer=_sgd_partial(),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PipelineStrategy(schedule="1f1b", microbatches=4, start_method="fork"),
        max_epochs=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    result = trainer.test(model, datamodule=data, verbose=False)[0]
    assert result["test_acc"] >= 0.93, result


def _sgd_partial() -> Any:
    import functools

    return functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)


# -- the app ---------------------------------------------------------------------------------------


def test_app_strategy_pipeline_two_stages(tmp_path: Path) -> None:
    """`python train.py strategy=pipeline trainer=ddp_sim`, in-process with fork-started ranks."""
    import json

    from app_utils import FEW_BATCHES, compose_cfg

    from recipes.train import run

    cfg = compose_cfg(["strategy=pipeline", "trainer=ddp_sim", "strategy.start_method=fork", *FEW_BATCHES], tmp_path)
    run(cfg)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # 2 processes but one replica: the scaling rule sees 1 replica (global batch 64, lr unscaled)
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 64, metrics
    assert metrics["lr"] == pytest.approx(0.05)


def test_metrics_reach_the_logger_at_each_epoch_end(tmp_path: Path) -> None:
    """Epochs of 4 steps under log_every_n_steps=50: Lightning writes no step metrics, so the
    pipeline's window is written at each epoch's last batch (steps 3 and 7), all stages agreeing."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=PipelineStrategy(start_method="fork", schedule="gpipe", microbatches=2),
        max_epochs=2,
        logger=CSVLogger(tmp_path, name="pipe"),
        log_every_n_steps=50,
        limit_train_batches=4,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=8))
    files = list(tmp_path.rglob("metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/bubble_fraction")]
    assert [int(r["step"]) for r in rows] == [3, 7], rows
    assert all(0.0 <= float(r["pipeline/bubble_fraction"]) < 1.0 for r in rows)
