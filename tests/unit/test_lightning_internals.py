"""The Lightning internals of ``strategies/_lightning_internals.py``: each test fails when a
Lightning release changes what the helper relies on (so the helper is the one place to fix)."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_strategies.strategies._lightning_internals import (
    every_n_train_steps,
    logged_step,
    per_rank_sigterm,
    should_update_logs,
)


def _trainer(log_every_n_steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, log_every_n_steps=log_every_n_steps,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip


def test_should_update_logs_follows_log_every_n_steps() -> None:
    trainer = _trainer(3)
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
    trainer = _trainer(1)
    per_rank_sigterm(trainer)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # no SIGTERM: nothing happens, no collective
    trainer._signal_connector.received_sigterm = True
    with pytest.raises(SIGTERMException):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()


def test_every_n_train_steps_reads_the_checkpoint_callbacks_option() -> None:
    assert every_n_train_steps(ModelCheckpoint(every_n_train_steps=5)) == 5
    assert every_n_train_steps(ModelCheckpoint(every_n_epochs=1)) == 0
    assert every_n_train_steps(object()) == 0
