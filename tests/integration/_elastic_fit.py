"""What one rank of an elastic async case runs: digits on 1 dedicated server + workers, "by hand".

Each rank is its own node to Lightning (``num_nodes=world``, ``devices=1``, ``NODE_RANK=rank``,
``LOCAL_RANK=0``), started independently by the test's zygote (``fault_utils``), so nothing but
the strategy decides what a survivor does. The model is the digits recipe's ``small_cnn`` at
width 8 on 8x8 images, 40 batches of 32 per epoch, SGD (momentum 0.3: asynchrony adds about
``1 - 1/P``); the chief (rank 0) validates on the 270 validation digits every epoch and tests at
the end.

The victim (a worker) stops itself at its training step ``step`` with ``fault``:

- ``"kill"``: SIGKILL (no handler runs, its sockets close);
- ``"stop"``: SIGSTOP (frozen with its sockets open; the zygote SIGKILLs it once the others exit);
- ``"term"``: SIGTERM (preemption: Lightning's handler, then the strategy's exit path).

Every rank writes ``<out>/rank<r>_<incarnation>.json`` when its fit ends: the steps it trained, the
(epoch, batch) pairs of its pushes; the chief adds the coordinator's accounting of every epoch,
its membership counters and events, the logged ``async/*`` metrics, validation accuracy per epoch
and the test accuracy. ``killed.json`` records the victim's signal.
"""

import faulthandler
import functools
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_strategies import AsyncElasticStrategy, AsyncParameterServerStrategy
from lightning_strategies.comm.ps import local_shard
from lightning_strategies.scaling import ScalingConfig
from recipes.classification import ClassificationModule
from recipes.data import DigitsDataModule
from recipes.models import build_model

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


#: ``"term"`` fires only in the first batches of an epoch (its index in the epoch at most this): the preempted
#: worker trains the batch it has drawn, so what it has to give back is the rest of its lease, which is empty
#: once the epoch's queue has run out (a victim whose step ``step`` was its last batch of an epoch gave back
#: nothing). In the first batches the queue still holds most of the epoch's 39 batches and the lease (4,
#: refilled at half) is never empty.
TERM_MAX_BATCH_IDX = 5


class _Fault(Callback):
    """The victim signals itself at the start of its training step ``step`` (``"term"``: the first step from
    ``step`` on whose batch is one of the epoch's first, :data:`TERM_MAX_BATCH_IDX`)."""

    def __init__(self, fault: str, step: int, out: Path) -> None:
        self.fault, self.step, self.out = fault, step, out
        self.fired = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.fired or trainer.global_step < self.step:
            return
        if self.fault == "term" and batch_idx > TERM_MAX_BATCH_IDX:
            return
        self.fired = True
        record = {"rank": trainer.global_rank, "step": trainer.global_step, "fault": self.fault, "time": time.time(),
                  "batch_idx": batch_idx}  # fmt: skip
        tmp = self.out / "killed.json.part"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.out / "killed.json")
        os.kill(os.getpid(), SIGNALS[self.fault])
        if self.fault == "term":
            time.sleep(0.5)  # Lightning's handler has set its flag: the loop stops at the next check


class _Sleep(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


class _Record(Callback):
    """Writes this rank's record when the fit ends (see the module doc)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.val_acc: list[float] = []
        self.logged: dict[str, list[float]] = {}
        self.trained: list[tuple[int, int]] = []  # (epoch, batch) of each step, from the lease
        self.accounting: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the chief: what its shard starts from (a resumed run must start from the checkpoint's)
        shard = local_shard(0)
        if trainer.global_rank == 0 and shard is not None:
            names = [n for n, _ in pl_module.named_parameters()]
            start = {
                "names": names,
                "slices": [(sl.tensor, sl.start, sl.stop) for sl in shard.slices],
                "values": [p.detach().clone() for p in shard.params],
                "state": shard.state_dict(),
                "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
            }
            torch.save(start, self.out / "start_state.pt")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, AsyncParameterServerStrategy)
        drawn = strategy._drawn  # the batch this step trains: the oldest drawn
        if drawn:
            self.trained.append((drawn[0].epoch, drawn[0].index))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and "val_acc" in trainer.callback_metrics:
            self.val_acc.append(float(trainer.callback_metrics["val_acc"]))
        coordinator = getattr(trainer.strategy, "coordinator", None)
        if coordinator is not None:  # every epoch's accounting (the coordinator keeps the last few)
            self.accounting[str(trainer.current_epoch)] = coordinator.accounting(trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, AsyncParameterServerStrategy)
        for key, value in trainer.callback_metrics.items():
            if key.startswith("async/") and value.numel() == 1:
                self.logged.setdefault(key, []).append(float(value))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)
        self.record["error"] = f"{type(exception).__name__}: {exception}"
        path = self.out / f"rank{trainer.global_rank}_{self.record['incarnation']}.json"
        path.write_text(json.dumps(self.record))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, AsyncElasticStrategy)
        members = strategy.members
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "incarnation": members.incarnation,
            "steps": trainer.global_step,
            "val_acc": self.val_acc,
            "logged": self.logged,
            "epoch": trainer.current_epoch,
            "pid": os.getpid(),
            "trained": self.trained,
        }
        coordinator = strategy.coordinator
        if coordinator is not None:
            record["accounting"] = self.accounting
            record["workers_lost"] = coordinator.workers_lost
            record["workers_joined"] = coordinator.workers_joined
            record["batches_redrawn"] = coordinator.batches_redrawn
            record["batches_returned"] = coordinator.batches_returned
            record["events"] = list(coordinator.events)
            record["monitor"] = members.monitor.events if members.monitor is not None else []
        self.record = record


def run_rank(rank: int, world: int, *, out_dir: str, epochs: int = 4, timeout_s: float = 20.0, fault: str = "",
             victim: int = -1, step: int = 10**9, slot: int = -1, world_size: int = 0, checkpoint: bool = False,
             resume: str = "", step_sleep: float = 0.0, num_servers: int = 1) -> None:  # fmt: skip
    """Fit (and, on the chief, test).

    ``slot``: this process relaunches rank ``slot`` of a ``world_size`` run once the victim is
    gone (``killed.json``), as a supervisor would: same rendezvous, same rank. ``step_sleep``:
    seconds each worker's step sleeps (a heavier model), so the run outlasts a relaunch."""
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, on demand
    out = Path(out_dir)
    if slot >= 0:
        rank, world = slot, world_size
        os.environ.update(NODE_RANK=str(slot), WORLD_SIZE=str(world_size))
        deadline = time.monotonic() + 120.0
        while not (out / "killed.json").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the victim never signalled itself: nothing to relaunch")
            time.sleep(0.05)
        time.sleep(0.5)  # the victim is gone (SIGKILL is immediate)
    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=32, image_size=8, seed=0)
    module = ClassificationModule(
        build_model("small_cnn", num_classes=10, in_channels=1, width=8),
        num_classes=10,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.3),
        scaling=ScalingConfig(rule="none", base_batch_size=32, decay="cosine"),
    )
    record = _Record(out)
    callbacks: list[Callback] = [record]
    if step_sleep and rank >= num_servers:
        callbacks.append(_Sleep(step_sleep))
    if rank == victim and slot < 0:
        callbacks.append(_Fault(fault, step, out))
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_epochs=1, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=AsyncElasticStrategy(
            dedicated_servers=True, num_servers=num_servers, timeout=timedelta(seconds=timeout_s)
        ),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=resume or None)
    if not hasattr(record, "record"):  # the loop never started (a relaunch after the run's last batch)
        record.on_train_end(trainer, module)
    result = dict(record.record)
    if rank == 0:
        result["test_acc"] = float(trainer.test(module, datamodule=data, verbose=False)[0]["test_acc"])
    path = out / f"rank{rank}_{result['incarnation']}.json"
    path.write_text(json.dumps(result))
    print(f"rank {rank}: fit finished at step {trainer.global_step}", flush=True)
