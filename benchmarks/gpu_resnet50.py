"""ResNet-50 training throughput (images/s) under ddp, ring and ps on a GPU: bf16-mixed, channels_last.

    python benchmarks/gpu_resnet50.py                 # on a CUDA machine (benchmarks/gpu_check.sh runs it)
    python benchmarks/gpu_resnet50.py --quick         # CI-sized, on the CPU: the script runs, no figure

Each round fits the recipe's ResNet-50 (ImageNet stem, 1000 classes) on synthetic 224 px images
once per strategy, interleaved (ddp, ring, ps, ddp, ...), so that clock and thermal drift hit all
alike. A fit trains ``--warmup`` steps (cuDNN picks its kernels), then times ``--steps`` steps
between two ``torch.cuda.synchronize()`` calls, the only host syncs the timing adds. Batches come
from loader workers into pinned memory and are copied ahead on a side stream (``DevicePrefetcher``).
Prints ``resnet50_images_per_s_{strategy}_w{P}`` (median over rounds) and ``{strategy}_over_ddp``.
World 1 always; world 2 only with two GPUs or more (NCCL refuses two ranks on one GPU, and gloo
stages every CUDA gradient through the host, which measures gloo, not the strategy).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl

from benchmarks._common import header, line, load_line, median
from lightning_strategies import ParameterServerStrategy, RingAllReduceStrategy
from recipes.classification import ClassificationModule
from recipes.data import SyntheticDataModule
from recipes.models import build_model

STRATEGIES = ("ddp", "ring", "ps")


class _ChannelsLast(ClassificationModule):
    """The recipe's module with every input batch in NHWC, as the weights are (tensor cores' layout)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x.contiguous(memory_format=torch.channels_last), y), batch_idx)


class _Timer(pl.Callback):
    """Wall time of steps ``[warmup, warmup + steps)``, synchronising the device at both ends only."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self._start = 0.0

    def _sync(self, module: pl.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self._sync(pl_module)
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.warmup + self.steps:  # counted once the step's update is done
            self._sync(pl_module)
            # in callback_metrics: what a spawned rank 0 hands back to the parent process
            trainer.callback_metrics["bench/seconds"] = torch.tensor(time.perf_counter() - self._start)
            trainer.should_stop = True


def _strategy(name: str, world: int) -> Any:
    launch: dict[str, Any] = {"start_method": "spawn"} if world > 1 else {}
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**launch)
    return {"ring": RingAllReduceStrategy, "ps": ParameterServerStrategy}[name](**launch)


def fit_once(name: str, *, world: int, batch: int, image_size: int, warmup: int, steps: int, quick: bool) -> float:
    """images/s of one fit (all ranks' images over rank 0's timed steps)."""
    pl.seed_everything(0, verbose=False)
    cuda = torch.cuda.is_available()
    data = SyntheticDataModule(
        batch_size=batch, num_samples=(warmup + steps + 1) * batch * world, val_samples=batch, test_samples=batch,
        image_size=image_size, num_classes=1000, num_workers=0 if quick else 8, pin_memory=cuda,
        persistent_workers=False, device_prefetch=cuda,
    )  # fmt: skip
    model = build_model("resnet50", num_classes=1000, stem="imagenet", width=64, channels_last=True)
    module = _ChannelsLast(
        model, num_classes=1000, optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-4)
    )
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=world, strategy=_strategy(name, world), precision="bf16-mixed",
        max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[_Timer(warmup, steps)],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    seconds = trainer.callback_metrics.get("bench/seconds")
    if seconds is None:
        raise RuntimeError(f"{name}: the timed steps did not run (an epoch shorter than {warmup + steps} steps?)")
    return steps * batch * world / float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128, help="per GPU")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="CI: 1 round of 2+2 steps at 32 px, batch 2, on the CPU")
    args = parser.parse_args()
    image_size = 224
    if args.quick:
        args.rounds, args.batch, args.warmup, args.steps, image_size = 1, 2, 2, 2, 32
    torch.backends.cudnn.benchmark = True
    print(header("gpu_resnet50"), flush=True)
    print(load_line("start"), flush=True)
    gpus = torch.cuda.device_count()
    if not torch.cuda.is_available():
        print("# no CUDA: the figures below are the CPU's (a smoke run, not a GPU measurement)", flush=True)
    worlds = [1, 2] if gpus >= 2 else [1]
    if gpus == 1:
        print("# world 2 skipped: one GPU (NCCL refuses two ranks on one GPU)", flush=True)
    for world in worlds:
        rates: dict[str, list[float]] = {name: [] for name in STRATEGIES}
        run = functools.partial(
            fit_once, world=world, batch=args.batch, image_size=image_size, warmup=args.warmup, steps=args.steps,
            quick=args.quick,
        )  # fmt: skip
        for _ in range(args.rounds):
            for name in STRATEGIES:
                rates[name].append(run(name))
        ddp = median(rates["ddp"])
        for name in STRATEGIES:
            line(f"resnet50_images_per_s_{name}_w{world}", median(rates[name]), "images/s")
        for name in STRATEGIES[1:]:
            line(f"{name}_over_ddp_w{world}", median(rates[name]) / ddp, "x")
    print(load_line("end"), flush=True)


if __name__ == "__main__":
    main()
