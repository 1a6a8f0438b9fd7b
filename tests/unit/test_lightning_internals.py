"""The Lightning internals of ``strategies/_lightning_internals.py`` (issue #26 allows three private
reads of the trainer, in one module): each test fails when a Lightning release changes what the
helper relies on (so the helper is the one place to fix)."""

from __future__ import annotations

import inspect
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies.strategies._lightning_internals import (
    every_n_train_steps,
    logged_step,
    per_rank_sigterm,
    predict_nothing,
    should_update_logs,
)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen: list[tuple[bool, int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        # what log_values reads: the step Lightning logs this one at
        self.seen.append((should_update_logs(trainer), trainer.fit_loop.epoch_loop._batches_that_stepped))
        return self.layer(batch[0]).sum()

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)


def _trainer(**kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip




def test_should_update_logs_follows_log_every_n_steps() -> None:
    trainer = _trainer(log_every_n_steps=3)
    trainer.training = True  # the fit loop is the active one
    loop = trainer.fit_loop.epoch_loop
    seen = []
    for stepped in range(6):
        loop._batches_that_stepped = stepped
        seen.append(should_update_logs(trainer))
        assert logged_step(trainer) == stepped
    # Lightning logs when (steps taken + 1) is a multiple of log_every_n_steps
    assert seen == [False, False, True, False, False, True]
    assert should_update_logs(None) is False


def test_the_sigterm_broadcast_is_a_method_the_epoch_loop_calls_and_per_rank_sigterm_replaces_it() -> None:
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert "broadcast(sigterm_tensor" in inspect.getsource(_TrainingEpochLoop._broadcast_sigterm_tensor)
    trainer = _trainer(log_every_n_steps=1)
    per_rank_sigterm(trainer)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # no SIGTERM: nothing happens, no collective
    trainer._signal_connector.received_sigterm = True
    with pytest.raises(SIGTERMException):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()


def test_every_n_train_steps_reads_the_checkpoint_callbacks_option() -> None:
    assert every_n_train_steps(ModelCheckpoint(every_n_train_steps=5)) == 5
    assert every_n_train_steps(ModelCheckpoint(every_n_epochs=1)) == 0
    assert every_n_train_steps(object()) == 0


def test_the_logger_connectors_cadence_and_the_logged_step_are_what_base_reads() -> None:
    module = _Tiny()
    _trainer(max_steps=4, log_every_n_steps=2).fit(module, _loader())
    # should_update_logs: every 2nd optimizer step; _batches_that_stepped: the steps before this one
    assert module.seen == [(False, 0), (True, 1), (False, 2), (True, 3)]


def test_predict_nothing_silences_the_predict_returned_none_warning() -> None:
    module = _Tiny()
    trainer = _trainer()
    with warnings.catch_warnings(record=True) as loud:
        warnings.simplefilter("always")
        assert trainer.predict(module, _loader()) == [None] * 4
    assert any("predict returned None" in str(w.message) for w in loud)  # what predict_nothing silences

    class Silence(pl.Callback):  # where the pipeline calls it: at setup, before the loop runs
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            predict_nothing(trainer)

    trainer = _trainer(callbacks=[Silence()])
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        assert trainer.predict(module, _loader()) is None
    assert not any("predict returned None" in str(w.message) for w in quiet)
