"""A tiny deterministic fit that ``torchrun`` launches (the multi-node and elastic tests).

Run under torchrun, e.g. two "nodes" on one machine::

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --rdzv-backend static \\
        --master-addr 127.0.0.1 --master-port 29500 tests/integration/_torchrun_fit.py \\
        --strategy ring --num-nodes 2 --devices 1 --out weights.pt

(and the same with ``--node-rank 1``). Lightning finds torchrun's environment
(``TorchElasticEnvironment``) and starts no processes itself. Global rank 0 saves the final
``state_dict`` to ``--out``.

With ``--ckpt-dir`` it checkpoints every epoch (``last.ckpt``) and resumes from ``last.ckpt``
when the file exists, so a run that ``torchrun --max-restarts`` restarts continues where the
last finished epoch left off. ``--die-rank R --die-at-step S --die-marker M`` makes rank ``R``
SIGKILL itself at the start of global step ``S`` unless ``M`` exists (it creates ``M`` first),
so it dies in the first attempt only. Each attempt's rank 0 appends ``restart=<n> start_step=<k>
checkpoint_io=<class> env=<cluster environment class>`` to ``<out>.attempts``, which tells the test
where each attempt began and which launcher's environment Lightning recognised. Under ``ps`` and
``ps1`` rank 0 also writes ``replies_per_bucket=<bool>`` to ``<out>.replies`` (what setup decided).

The tests also import :func:`fit` to run the same fit fork-started as the reference.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_utils import GlobalBatchSampler, TinyRegressor, regression_data
from torch import nn
from torch.utils.data import DataLoader

from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    RingAllReduceStrategy,
)

STRATEGIES = ("ring", "ps", "ps1", "pipeline", "async", "ddp")
BATCH_PER_REPLICA = 8  # global batch 16 at 2 processes (ring, ps); the pipeline's one replica gets 16
PS1_BUCKET_BYTES = 256  # ps1's push buckets: the regressor's 4 tensors (16-512 bytes) in 2 buckets


class PipeTinyRegressor(TinyRegressor):
    """:class:`TinyRegressor` plus the two :class:`~lightning_strategies.PipelineModule` methods."""

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


def make_strategy(name: str, start_method: str = "popen") -> pl.strategies.Strategy:
    """The strategy ``name`` (one of :data:`STRATEGIES`), started by ``start_method``."""
    if name == "ring":
        return RingAllReduceStrategy(start_method=start_method)
    if name == "ps":
        return ParameterServerStrategy(start_method=start_method)
    if name == "ps1":  # one server, two buckets: across nodes each bucket is answered alone
        return ParameterServerStrategy(start_method=start_method, num_servers=1, bucket_cap_mb=PS1_BUCKET_BYTES / 2**20)
    if name == "pipeline":
        return PipelineStrategy(start_method=start_method)
    if name == "async":
        return AsyncParameterServerStrategy(start_method=start_method)
    if name == "ddp":
        return pl.strategies.DDPStrategy(start_method=start_method)
    raise ValueError(f"unknown strategy {name!r}: expected one of {STRATEGIES}")


def make_loader(name: str, world_size: int) -> DataLoader:
    """Step k covers samples ``[16k, 16k + 16)`` for every strategy and world size of 2."""
    data = regression_data()
    if name == "pipeline":
        # Every stage of the (single) replica needs the whole global batch, in order.
        return DataLoader(data, batch_size=BATCH_PER_REPLICA * world_size, drop_last=True)
    return DataLoader(data, batch_size=BATCH_PER_REPLICA, sampler=GlobalBatchSampler(len(data), BATCH_PER_REPLICA))


class _DieOnce(Callback):
    """SIGKILL rank ``rank`` at the start of global step ``step``, once (guarded by ``marker``)."""

    def __init__(self, rank: int, step: int, marker: Path) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("killed\n")
            os.kill(os.getpid(), signal.SIGKILL)


class _RecordStart(Callback):
    """Rank 0 notes where this attempt starts training (after any checkpoint was restored)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
            with self.path.open("a") as f:
                io = type(trainer.strategy.checkpoint_io).__name__
                env = type(trainer.strategy.cluster_environment).__name__
                f.write(f"restart={restart} start_step={trainer.global_step} checkpoint_io={io} env={env}\n")


class _RecordReplies(Callback):
    """Rank 0 writes ``replies_per_bucket=<bool>`` to ``path``: whether this fit's shards answered each
    bucket alone (:attr:`ParameterServerStrategy.replies_per_bucket`, decided at setup); ps only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and isinstance(trainer.strategy, ParameterServerStrategy):
            self.path.write_text(f"replies_per_bucket={trainer.strategy.replies_per_bucket}\n")


def fit(
    name: str,
    strategy: pl.strategies.Strategy,
    *,
    devices: int,
    num_nodes: int = 1,
    max_steps: int = -1,
    max_epochs: int | None = None,
    callbacks: list[Callback] | None = None,
    ckpt_dir: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Fit the tiny regressor with ``strategy``; return the final weights (full model on rank 0)."""
    model = PipeTinyRegressor() if name == "pipeline" else TinyRegressor()
    callbacks = list(callbacks or [])
    ckpt_path: str | None = None
    if ckpt_dir is not None:
        # Epoch boundaries only: Lightning 2.6 restarts a plain DataLoader from batch 0 after a
        # mid-epoch resume, which would replay batches an uninterrupted run does not.
        # (save_top_k stays 1: Lightning 2.6 writes last.ckpt at an epoch end only together with a top-k file)
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_last=True))
        last = ckpt_dir / "last.ckpt"
        ckpt_path = str(last) if last.exists() else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    trainer.fit(model, make_loader(name, devices * num_nodes), ckpt_path=ckpt_path)
    # A pipeline rank's module holds its own stages only; the whole trained model is what the
    # strategy gathered on rank 0 at the end of fit (what a checkpoint saved after fit holds).
    state = trainer.strategy.lightning_module_state_dict() if name == "pipeline" else model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--devices", type=int, required=True, help="processes per node (torchrun --nproc-per-node)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 saves the final state_dict here")
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--die-marker", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    callbacks: list[Callback] = [
        _RecordStart(Path(f"{args.out}.attempts")),
        _RecordReplies(Path(f"{args.out}.replies")),
    ]
    if args.die_rank is not None:
        assert args.die_at_step is not None and args.die_marker is not None, "--die-* go together"
        callbacks.append(_DieOnce(args.die_rank, args.die_at_step, args.die_marker))
    weights = fit(
        args.strategy,
        make_strategy(args.strategy),
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        ckpt_dir=args.ckpt_dir,
    )
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:  # torchrun or SLURM
        tmp = args.out.with_name(args.out.name + ".part")
        torch.save(weights, tmp)
        os.replace(tmp, args.out)  # the test never reads a half-written file
    if dist.is_initialized() and args.strategy != "pipeline":
        # Lightning leaves the process groups to interpreter exit; the other strategies' runs end
        # with every group destroyed here. PipelineStrategy.teardown destroys the groups it made
        # itself (a pipeline worker used to abort at exit without this: "terminate called without
        # an active exception"), so its run exits as a user's script would, with nothing added.
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
