"""PipelineStrategy holds only each rank's stages: tensors accounted, a memory cap enforced, predictions once.

- Bytes: after a fit, the parameter, gradient and optimizer-state bytes each rank holds (from the
  tensors themselves) are its stages' share of the unsplit model's, exactly, for 2 and 3 stages
  and 2 replicas x 2 stages; the other stages' parameters are ``meta`` placeholders.
- A cap: a wide MLP whose parameters + gradients + momentum (3 x 151 MB) exceed a per-process
  cap of 2.25 x its parameters fits under that cap as 2 stages on 2 processes (1.5 x each) and
  fails under it on one process (3 x). The cap is ``RLIMIT_DATA`` set in each rank relative to its
  own ``VmData`` at setup (the private writable memory the kernel counts against the limit:
  heap and anonymous mappings, not the CUDA build's several GB of mapped libraries that an
  address-space cap would have to leave room for), so it is exact on a loaded machine.
- Predict: each sample's prediction is returned once, by each replica's last stage.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dist_utils import run_workers
from lightning_utils import regression_data
from test_pipeline_strategy import PipeRegressor, deep_net, fit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies.comm.pipeline import partition_blocks
from lightning_strategies.comm.pipeline_stages import StageLayout
from lightning_strategies.strategies.pipeline import PipelineStrategy

pytestmark = pytest.mark.slow


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and not t.is_meta)


class _HeldBytes(pl.Callback):
    """At the end of fit (the last step's gradients and momentum still there), this rank's bytes of
    parameters, gradients and optimizer state, and which blocks it holds, into ``rank<r>.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        blocks = pl_module.pipeline_layers()  # type: ignore[operator]
        held = [i for i, b in enumerate(blocks) if any(not p.is_meta for p in b.parameters())]
        row = {
            "params": _bytes(params),
            "grads": _bytes(p.grad for p in params),
            "state": _bytes(state),
            "held_blocks": held,
            "meta_params": sum(p.is_meta for p in params),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


@pytest.mark.parametrize(("devices", "num_stages"), [(2, 2), (3, 3), (4, 2)], ids=["2stages", "3stages", "2x2"])
def test_each_rank_holds_its_stages_share_of_params_grads_and_momentum(
    devices: int, num_stages: int, tmp_path: Path
) -> None:
    """Expected bytes from the unsplit model: the parameters of the blocks of this rank's stages
    under the parameter-balanced split, x 4 bytes, for each of parameters, gradients and SGD's
    momentum buffers (the module has no tensors outside its blocks)."""
    replicas = devices // num_stages
    fit(
        PipelineStrategy(num_stages=num_stages, microbatches=4, start_method="fork"),
        devices,
        batch_size=16 // replicas,
        distributed_sampler=replicas > 1,
        callbacks=[_HeldBytes(tmp_path)],
    )
    blocks = deep_net()
    numels = [sum(p.numel() for p in b.parameters()) for b in blocks]
    layout = StageLayout(tuple(partition_blocks(numels, num_stages)), num_stages)
    total_params = len(list(blocks.parameters()))
    for rank in range(devices):
        row = json.loads((tmp_path / f"rank{rank}.json").read_text())
        mine = layout.blocks_of(rank % num_stages)
        share = 4 * sum(numels[i] for i in mine)
        assert row["held_blocks"] == [i for i in mine if numels[i]], rank
        assert (row["params"], row["grads"], row["state"]) == (share, share, share), (rank, row)
        own_params = sum(len(list(blocks[i].parameters())) for i in mine)
        assert row["meta_params"] == total_params - own_params, rank


# -- a model that does not fit the cap on one process -------------------------------------------------

WIDTH, LAYERS = 3072, 4  # 4 x 3072^2 float32 weights: 151 MB, each tensor above glibc's mmap threshold
CAP = 2.25  # x the model's parameter bytes: between one stage's 1.5 x and the whole model's 3 x


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _wide_param_bytes() -> int:
    return LAYERS * (WIDTH * WIDTH + WIDTH) * 4


class WideRegressor(PipeRegressor):
    """The wide MLP built in ``configure_model`` (on ``meta`` under the pipeline), plain SGD + momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class _Cap(pl.Callback):
    """Caps this rank's private writable memory at its VmData at setup + ``CAP`` x the parameters."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        limit = _vm_data() + int(CAP * _wide_param_bytes())
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # rank 0's callback metrics reach the caller of a fork-launched fit
        trainer.callback_metrics["test/steps"] = torch.tensor(float(trainer.global_step))


def _wide_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g))
    return DataLoader(data, batch_size=4)


def _capped_single_process(rank: int, world: int) -> str:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[_Cap()],
    )  # fmt: skip
    try:
        trainer.fit(WideRegressor(), _wide_loader())
    except RuntimeError as err:
        return str(err)
    return "fit"


def test_a_model_over_the_cap_fits_as_two_stages_and_not_on_one_process() -> None:
    """Under the same cap (each process's own VmData at setup + 2.25 x the 151 MB of parameters):
    2 stages on 2 fork-started processes fit 2 steps (each rank: 1.5 x, plus rank 0's one block
    in transit at setup); one process runs out of memory (3 x). The model is built in
    ``configure_model``, so no process ever holds more than its stages plus that block."""
    (single,) = run_workers(_capped_single_process, 1, timeout=120)
    assert "can't allocate memory" in single, single
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(microbatches=2, start_method="fork", timeout=_60s()),
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[_Cap()],
    )  # fmt: skip
    trainer.fit(WideRegressor(), _wide_loader())
    assert float(trainer.callback_metrics["test/steps"]) == 2


def _60s() -> Any:
    from datetime import timedelta

    return timedelta(seconds=60)  # a rank that ran out of memory fails the others within a minute


# -- predictions ------------------------------------------------------------------------------------------


def _predict(rank: int, world: int, num_stages: int) -> Any:
    os.environ["LOCAL_RANK"] = str(rank)  # the processes exist already: Lightning starts none
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=PipelineStrategy(num_stages=num_stages, microbatches=2),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    loader = DataLoader(regression_data(n=30, seed=1), batch_size=6)  # 5 batches; Lightning shards over replicas
    out = trainer.predict(PipeRegressor(), loader)
    return None if out is None else [batch.tolist() for batch in out]


@pytest.mark.parametrize(("world", "num_stages"), [(2, 2), (4, 2)], ids=["2stages", "2x2"])
def test_predict_returns_each_sample_once_from_the_last_stage(world: int, num_stages: int) -> None:
    """Each replica's last-stage rank returns its share of the predictions, the other stage ranks
    None; together every sample once, equal to the unsplit model's predictions (float32, the same
    operations per sample: rtol 1e-6)."""
    results = run_workers(_predict, world, num_stages, timeout=120)
    last = [r for r in range(world) if r % num_stages == num_stages - 1]
    assert all(results[r] is None for r in range(world) if r not in last), results
    rows = [row for r in last for batch in results[r] for row in batch]
    x, _ = regression_data(n=30, seed=1).tensors
    with torch.no_grad():
        want = PipeRegressor()(x)
    assert len(rows) == len(want)  # each sample once: 30 rows, not 30 x stages
    got = torch.tensor(sorted(rows))
    torch.testing.assert_close(got, torch.tensor(sorted(want.tolist())), rtol=1e-6, atol=1e-7)


class _Counting(PipeRegressor):
    """Counts validation samples two ways: a summed, synced self.log and a torchmetrics SumMetric."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.seen = torchmetrics.SumMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self(x)
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True, batch_size=len(x))
        self.seen.update(torch.ones(len(x)))
        self.log("seen", self.seen, batch_size=len(x))


@pytest.mark.parametrize(("devices", "num_stages"), [(2, 2), (4, 2)], ids=["2stages", "2x2"])
def test_validation_counts_each_sample_once(devices: int, num_stages: int) -> None:
    """Every stage rank runs validation_step on the last stage's outputs (so all log the same
    keys), but synced logs and torchmetrics states reduce over the replicas: 30 samples count 30,
    not 30 x stages (a world-wide sum gives 60)."""
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=PipelineStrategy(num_stages=num_stages, start_method="fork"),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    (result,) = trainer.validate(_Counting(), DataLoader(regression_data(n=30, seed=1), batch_size=8), verbose=False)
    assert (result["samples"], result["seen"]) == (30.0, 30.0), result
