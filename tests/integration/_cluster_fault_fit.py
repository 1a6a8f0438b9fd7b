"""What every torchrun worker of ``test_cluster_faults.py`` runs: a short fit that checkpoints every epoch.

    _cluster_fault_fit.py --strategy ring --epochs 6 --out DIR [--cut-epoch 3] [--resume CKPT]

The model is ``benchmarks/emulated/_fit.py``'s MLP, narrow (``--width``), trained by SGD with
momentum on two fixed batches per epoch (every rank the same ones, no sampler: the pipeline's
stages and a tensor-parallel group need the same batches, and data-parallel replicas averaging
equal gradients are as exact as any). ``ModelCheckpoint`` writes ``DIR/ckpt/last.ckpt`` at every
epoch end, so a resume starts at an epoch boundary, where Lightning's loops restore exactly.

``--cut-epoch E``: at the start of epoch E, global rank 0 writes ``DIR/cut.request`` and waits
(at most ``CUT_WAIT_S``) for ``DIR/cut.done``, which the test writes once it has taken the last
node's link down: every other rank is then already inside the epoch's first step, so the cut
lands during a fit, between two checkpoints. Every rank writes ``DIR/rank<r>.exception`` (time
and message) when its fit fails, and ``DIR/rank<r>.exit`` (time) when its interpreter begins to
exit (after Lightning's teardown), so the test can time each survivor's diagnosis and teardown.

The checkpoint of the last epoch, ``DIR/ckpt/last.ckpt`` (rank 0 writes it; every strategy
gathers its full state for it), holds the final weights and optimizer state to compare. It is
written inside the fit: after it the pipeline's and tensor's groups are torn down, so a
``trainer.save_checkpoint`` there would have no group to gather over.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.emulated._fit import IN, MLP, OUT
from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    RingAllReduceStrategy,
    TensorParallelStrategy,
)

STRATEGIES = ("ring", "ps", "async", "pipeline", "tensor")
BATCHES_PER_EPOCH = 2
CUT_WAIT_S = 60.0


class Net(MLP):
    """The benchmark's MLP with momentum (optimizer state a resume must carry over)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def make_strategy(name: str, timeout_s: float, grace_s: float) -> Any:
    """``name`` with a short ``timeout`` and heartbeat watch grace, so a cut link fails the fit fast."""
    timeout = timedelta(seconds=timeout_s)
    classes = {"ring": RingAllReduceStrategy, "ps": ParameterServerStrategy, "async": AsyncParameterServerStrategy,
               "pipeline": PipelineStrategy, "tensor": TensorParallelStrategy}  # fmt: skip
    strategy = classes[name](timeout=timeout)
    strategy.peer_watch_grace = grace_s
    return strategy


class CutLink(Callback):
    """Rank 0 asks for the cut at the start of epoch ``epoch`` and waits until it is done."""

    def __init__(self, epoch: int, out: Path) -> None:
        self.epoch, self.out = epoch, out

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0 or trainer.current_epoch != self.epoch or batch_idx != 0:
            return
        (self.out / "cut.request").write_text(json.dumps({"step": trainer.global_step, "time": time.time()}))
        deadline = time.monotonic() + CUT_WAIT_S
        while not (self.out / "cut.done").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test did not cut the link within {CUT_WAIT_S:.0f} s")
            time.sleep(0.01)


class RecordException(Callback):
    """``rank<r>.exception``: when this rank's fit failed and with what message."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        record = {"time": time.time(), "type": type(exception).__name__, "message": str(exception)[:4000],
                  "step": trainer.global_step}  # fmt: skip
        (self.out / f"rank{trainer.global_rank}.exception").write_text(json.dumps(record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=15.0, help="the strategy's timeout, seconds")
    parser.add_argument("--grace", type=float, default=3.0, help="the strategy's peer_watch_grace, seconds")
    parser.add_argument("--cut-epoch", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    atexit.register(lambda: (args.out / f"rank{rank}.exit").write_text(json.dumps({"time": time.time()})))
    g = torch.Generator().manual_seed(0)
    n = args.batch * BATCHES_PER_EPOCH
    data = TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))
    callbacks: list[Callback] = [
        RecordException(args.out),
        ModelCheckpoint(
            dirpath=args.out / "ckpt", save_last=True, save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True
        ),
    ]
    if args.cut_epoch is not None:
        callbacks.append(CutLink(args.cut_epoch, args.out))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=make_strategy(args.strategy, args.timeout, args.grace),
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    model = Net(args.width, 2)
    trainer.fit(model, DataLoader(data, batch_size=args.batch), ckpt_path=args.resume)
    if dist.is_initialized() and args.strategy != "pipeline":
        dist.destroy_process_group()  # as benchmarks/emulated/_fit.py: pipeline's teardown does it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
