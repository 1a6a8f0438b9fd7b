"""One replica of an ``ft`` / ``local_sgd`` / ``diloco`` case: ``python _ft_fit.py case.json``.

Run once per case by the test: this process is replica 0; the strategy's launcher starts the
others (the same command, ``LOCAL_RANK=r``), the Lighthouse, and starts a killed replica again.
The model is :class:`~lightning_utils.TinyRegressor` on :func:`~lightning_utils.regression_data`,
each replica on its shard (Lightning's ``DistributedSampler``), one torch thread per process.

The case file's keys: ``out``, ``replicas``, ``algorithm``, ``max_steps``, ``batch_size``, ``n``,
``strategy`` (FTStrategy keyword arguments), ``kill`` (``[replica, step]``: that replica
SIGKILLs itself at the start of its training step of that index in its first start, counted from its
first step in this process), ``kill_in_allreduce`` (``[replica, n, when]``: that replica SIGKILLs
itself inside its ``n``-th outer sync of its first start, through
:attr:`~lightning_strategies.comm.ft.OuterSync.on_issue`: ``"issued"`` right after it handed its values
to the all-reduce, before anything waited for it; ``"quorum"`` in the sync's quorum, before it handed
them over, so that the peers' all-reduces lose it in flight),
``sleep_alone_s`` (after every step committed alone), ``hold_alone_s`` (after a kill, a replica
training alone waits up to this long, once, for the restarted replica to reach its join: the
restart's fresh interpreter is slow on a loaded machine, and the heal must happen before the
survivor's last step), ``seed_by_replica`` (each replica initialises its weights with its own seed),
``optimizer`` (``"sgd"`` or ``"adamw"``), ``ckpt_save`` (``[step, path]``: replica 0 saves a
checkpoint there after that step and the fit stops), ``ckpt_path`` (resume from it), ``resumable``
(a :class:`~lightning_strategies.ResumableDataLoader`, so that a mid-epoch resume takes the next batch).

Each replica writes ``replica<r>_<start>.pt`` when its fit ends: its final weights, Lightning's
``global_step``, the Manager's step, its heals, per committed step the participants, and its outer syncs
(:class:`~lightning_strategies.comm.ft.SyncRecord`: steps and times of each all-reduce's issue and wait).
"""

# ruff: noqa: E402 - T0 is taken before the imports it times
from __future__ import annotations

import time

T0 = time.time()  # this process's start (before the heavy imports): a restart's rejoin is timed from it

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utils import StopAfter, TinyRegressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

from lightning_strategies import FTStrategy, ResumableDataLoader
from lightning_strategies.strategies._ft_launcher import RESTART_ENV


class _Case(pl.Callback):
    def __init__(self, cfg: dict[str, Any], replica: int, start: int) -> None:
        self.cfg, self.replica, self.start = cfg, replica, start
        self.participants: list[int] = []
        self.manager_steps: list[int] = []
        self.first_step: int | None = None
        self.steps_here = 0
        self.commit_times: list[float] = []
        self.t_start = time.time()
        self.t_first: float | None = None
        self.issued = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.start > 0:  # a restart about to join (its first quorum follows): a survivor holding may go on
            (Path(self.cfg["out"]) / f"ready{self.replica}_{self.start}").touch()
        kill, strategy = self.cfg.get("kill_in_allreduce"), trainer.strategy
        assert isinstance(strategy, FTStrategy)
        if kill and self.start == 0 and self.replica == kill[0] and strategy.syncer is not None:
            strategy.syncer.on_issue = lambda when, fragment, step: self._kill_in_allreduce(kill, when, step)

    def _kill_in_allreduce(self, kill: list[Any], when: str, step: int) -> None:
        self.issued += when == "quorum"
        if self.issued == kill[1] and when == kill[2]:
            record = {"time": time.time(), "step": step, "when": when}
            (Path(self.cfg["out"]) / "killed.json").write_text(json.dumps(record))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first_step is None:
            self.first_step = trainer.global_step
        self.steps_here += 1
        kill = self.cfg.get("kill")
        if kill and self.start == 0 and self.replica == kill[0] and self.steps_here == kill[1] + 1:
            (Path(self.cfg["out"]) / "killed.json").write_text(json.dumps({"time": time.time(), "step": kill[1]}))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FTStrategy) and strategy.replica is not None
        if self.t_first is None:
            self.t_first = time.time()
        self.participants.append(strategy.replica.participants())
        self.commit_times.append(time.time())
        self.manager_steps.append(strategy.replica.step)
        if self.cfg.get("sleep_alone_s") and self.participants[-1] == 1:
            time.sleep(self.cfg["sleep_alone_s"])
        out = Path(self.cfg["out"])
        if self.cfg.get("hold_alone_s") and self.participants[-1] == 1 and (out / "killed.json").exists():
            deadline = time.monotonic() + self.cfg.pop("hold_alone_s")  # once
            while not any(out.glob("ready*_*")) and time.monotonic() < deadline:
                time.sleep(0.2)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FTStrategy) and strategy.replica is not None
        record = {
            "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            "global_step": trainer.global_step,
            "manager_step": strategy.replica.step,
            "heals": strategy.replica.heals,
            "participants": self.participants,
            "manager_steps": self.manager_steps,
            "first_step": self.first_step,
            "outer": strategy.outer.state_dict() if strategy.outer is not None else None,
            "syncs": [dataclasses.asdict(r) for r in strategy.syncer.history] if strategy.syncer is not None else [],
            "optimizer": trainer.optimizers[0].state_dict(),
            "t_start": self.t_start,
            "t0": T0,
            "commit_times": self.commit_times,
            "allreduce_bytes": strategy.comm_stats.bytes_sent,
            "allreduce_calls": strategy.comm_stats.calls,
            "t_first": self.t_first,
            "t_end": time.time(),
            "pid": os.getpid(),
        }
        torch.save(record, Path(self.cfg["out"]) / f"replica{self.replica}_{self.start}.pt")


def _optimizer(name: str) -> Any:
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=0.01)
    return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    replica = int(os.environ.get("LOCAL_RANK", "0"))
    start = int(os.environ.get(RESTART_ENV, "0"))
    model = TinyRegressor(_optimizer(cfg.get("optimizer", "sgd")), batchnorm=cfg.get("batchnorm", False))
    if cfg.get("seed_by_replica"):
        torch.manual_seed(1000 + replica)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.5)
    data = regression_data(cfg.get("n", 64))
    loader_class = ResumableDataLoader if cfg.get("resumable") else DataLoader  # mid-epoch resume at the next batch
    loader = loader_class(data, batch_size=cfg.get("batch_size", 8))
    callbacks: list[pl.Callback] = [_Case(cfg, replica, start)]
    if cfg.get("ckpt_save"):
        callbacks.append(StopAfter("batch", Path(cfg["ckpt_save"][1]), step=cfg["ckpt_save"][0]))
    strategy = FTStrategy(algorithm=cfg.get("algorithm", "ft"), **cfg.get("strategy", {}))
    trainer = quiet_trainer(strategy, cfg["replicas"], max_steps=cfg["max_steps"], callbacks=callbacks)
    trainer.fit(model, loader, ckpt_path=cfg.get("ckpt_path"))


if __name__ == "__main__":
    main()
