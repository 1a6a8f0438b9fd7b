"""Lightning internals this package touches (no public way exists); tests/unit/test_lightning_internals.py pins each."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["every_n_train_steps", "logged_step", "per_rank_sigterm", "predict_nothing", "should_update_logs"]


def should_update_logs(trainer: pl.Trainer | None) -> bool:
    """Whether Lightning writes step metrics at this step (ranks agree: it depends on the global step only)."""
    if trainer is None:
        return False
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except (AttributeError, NotImplementedError):  # another Lightning version: log every step
        return True


def logged_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs the current one at (0-based, as its logger connector does)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def every_n_train_steps(callback: object) -> int:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` (0 for none, or for another callback)."""
    return int(getattr(callback, "_every_n_train_steps", 0) or 0)


def per_rank_sigterm(trainer: pl.Trainer) -> None:
    """Replace the training loop's per-step SIGTERM broadcast by a local check (each rank still stops on
    its own SIGTERM). Lightning broadcasts the flag from rank 0 before every step, with no option to turn
    it off; when ranks take different numbers of steps (``"async"``) it would pair with a peer's
    epoch-end collective."""

    def check_sigterm() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check_sigterm  # type: ignore[method-assign]


def predict_nothing(trainer: pl.Trainer) -> None:
    """Make ``trainer.predict()`` return ``None``, unwarned, on a rank without predictions (early pipeline stages)."""
    loop = trainer.predict_loop
    loop.return_predictions = False
    # Lightning has no public switch for the warning; its cache skips a message it holds already.
    loop._warning_cache.add("predict returned None if it was on purpose, ignore this warning...")
