"""A callback for ``benchmarks/cluster_diloco.py``: validation accuracy against training time.

Added to the digits app's callbacks on the command line
(``+callbacks.timeline={_target_: benchmarks.emulated._timeline.ValTimeline, path: ..., sync_every: H}``).
Each validation (not the sanity check) is recorded as ``(global step, training seconds, val_acc)``,
where training seconds run from ``on_train_start`` (process start, rendezvous, DDP's first
broadcast and DiLoCo's first quorum left out for both) and leave out the time spent validating
so far, so that validating more often does not slow a strategy down. Global rank 0 writes the
records to ``path`` at the end of the fit.

Under DiLoCo (``sync_every`` = H > 0) the outer sync due after step k x H is run at the end of that
step (``FTStrategy.final_sync``, the same sync the strategy would run at the start of the next
batch), so the validation that follows sees the global weights, not one replica's inner ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["ValTimeline"]


class ValTimeline(pl.Callback):
    """Records ``(step, train_s, val_acc)`` at every validation; rank 0 writes them to ``path``.

    Args:
        path: the JSON file rank 0 writes at the end of the fit.
        sync_every: DiLoCo's H, whose due sync is run before the validation; 0 for other strategies.
    """

    def __init__(self, path: str, sync_every: int = 0) -> None:
        self.path = Path(path)
        self.sync_every = sync_every
        self.t0 = 0.0
        self.val_s = 0.0
        self.v0 = 0.0
        self.records: list[dict[str, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.t0, self.val_s = time.perf_counter(), 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.sync_every and trainer.global_step % self.sync_every == 0:
            trainer.strategy.final_sync()  # type: ignore[attr-defined]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.v0 = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        if trainer.sanity_checking:
            return
        acc = trainer.callback_metrics.get("val_acc")
        self.records.append({"step": trainer.global_step, "train_s": self.v0 - self.t0 - self.val_s,
                             "val_acc": float(acc) if acc is not None else float("nan")})  # fmt: skip
        self.val_s += now - self.v0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        train_s = time.perf_counter() - self.t0 - self.val_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"records": self.records, "steps": trainer.global_step, "train_s": train_s}))
