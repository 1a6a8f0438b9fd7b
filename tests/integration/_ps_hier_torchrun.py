"""What each torchrun worker of ``test_ps_hierarchical_torchrun.py`` runs (2 "nodes" x 2 processes).

Seven tiny fits in a row on the same processes, each a fresh ``Trainer``: ``ParameterServerStrategy()``
(``hierarchical=None``, so hierarchical on 2 nodes; ``overlap=True``, in buckets of 64 bytes so that the
tiny model makes 3), the same with ``overlap=False`` (the one-shot hierarchical push after backward) and
``ParameterServerStrategy(hierarchical=False)``, with SGD-momentum (elementwise plan) and with Lamb
(whole-tensor plan); and SGD-momentum with ``accumulate_grad_batches=2``, overlapped and not. Rank 0 saves
each fit's weights and the optimizer state gathered from the shards to ``<out-dir>/<fit>.pt``; every rank
writes ``<out-dir>/rank<r>.json``: per fit, whether the push was hierarchical, the node layout, the shard
plan's elements per shard, the ``comm/`` metrics it logged and, overlapped, the push's step timeline.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _torchrun_fit import make_loader
from lightning.pytorch.callbacks import Callback
from lightning_utils import TinyRegressor, quiet_trainer, sgd_momentum

from lightning_strategies import ParameterServerStrategy
from lightning_strategies.comm.ps import partition_loads
from lightning_strategies.optim import Lamb

MAX_STEPS = 6
# 64-byte buckets over TinyRegressor's 4 tensors (512, 64, 256, 16 bytes): 3 buckets, in reverse layer order
BUCKET_CAP_MB = 64 / 2**20
#: fit name -> (optimizer, hierarchical, overlap, accumulate_grad_batches)
FITS: dict[str, tuple[str, bool | None, bool, int]] = {
    "sgd_momentum_hier": ("sgd_momentum", None, True, 1),
    "sgd_momentum_hier_serial": ("sgd_momentum", None, False, 1),
    "sgd_momentum_flat": ("sgd_momentum", False, True, 1),
    "lamb_hier": ("lamb", None, True, 1),
    "lamb_flat": ("lamb", False, True, 1),
    "sgd_momentum_hier_accum": ("sgd_momentum", None, True, 2),
    "sgd_momentum_hier_serial_accum": ("sgd_momentum", None, False, 2),
}


def lamb(params: Any) -> torch.optim.Optimizer:
    return Lamb(params, lr=0.02, weight_decay=0.01)


OPTIMIZERS = {"sgd_momentum": sgd_momentum, "lamb": lamb}


class PushRecord(Callback):
    """The push's layout, the shard plan and the ``comm/`` values this rank logged last."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ParameterServerStrategy) and strategy.client is not None
        layout = getattr(strategy.client, "push_layout", None)
        self.record.update(
            hierarchical=strategy.is_hierarchical,
            client=type(strategy.client).__name__,
            nodes=[list(n) for n in layout.layout.nodes] if layout is not None else None,
            shard_numel=partition_loads(strategy.client.plan),
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}
        self.record["global_step"] = trainer.global_step
        self.record["batches_per_epoch"] = trainer.num_training_batches
        overlap = trainer.strategy.overlap  # type: ignore[attr-defined]
        if overlap is not None:
            push = overlap.push
            self.record["push"] = type(push).__name__
            self.record["buckets"] = [list(b.tensors) for b in push.buckets]
            self.record["timeline"] = [
                {
                    **vars(t),
                    "pull_arrived": sorted(t.pull_arrived.values()),
                    "pull_landed": sorted(t.pull_landed.values()),
                }
                for t in push.timeline
            ]


def one_fit(
    optimizer: str, hierarchical: bool | None, overlap: bool, accumulate: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    model = TinyRegressor(optimizer_factory=OPTIMIZERS[optimizer])
    keep = PushRecord()
    strategy = ParameterServerStrategy(
        hierarchical=hierarchical, overlap=overlap, bucket_cap_mb=BUCKET_CAP_MB, timeout=timedelta(seconds=60)
    )
    trainer = quiet_trainer(strategy, 2, num_nodes=2, max_steps=MAX_STEPS // accumulate, use_distributed_sampler=False,
                            accumulate_grad_batches=accumulate, callbacks=[keep])  # fmt: skip
    trainer.fit(model, make_loader("ps", 4))
    # the shards' optimizer state as gathered over RPC at the end of fit (what a checkpoint after fit holds)
    state = trainer.strategy.optimizer_state(trainer.optimizers[0])
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "optimizer": state}, keep.record


def run_fits(fits: dict[str, tuple[Any, ...]], one_fit: Callable[..., tuple[Any, dict[str, Any]]], *,
             every_rank: bool, description: str) -> None:  # fmt: skip
    """Each of ``fits`` in turn (``one_fit(*options)``) on this rank; under ``--out-dir``, the weights
    (``<name>.pt`` from rank 0, or ``<name>_rank<r>.pt`` from ``every_rank``) and ``rank<r>.json``, the records."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    records = {}
    for name, options in fits.items():
        weights, record = one_fit(*options)
        # rank 0 hosts each fit's RPC rendezvous store: the next fit must not replace it while a peer's
        # graceful RPC shutdown still reads it
        dist.barrier()
        records[name] = record
        if every_rank:
            torch.save(weights, args.out_dir / f"{name}_rank{rank}.pt")
        elif rank == 0:
            torch.save(weights, args.out_dir / f"{name}.pt")
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(records))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_fits(FITS, one_fit, every_rank=False, description=__doc__.splitlines()[0])
