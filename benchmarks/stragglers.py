"""Stragglers: asynchronous against synchronous parameter servers when one worker is k times slower.

P fork-started CPU processes (gloo + TensorPipe RPC on 127.0.0.1, one torch thread each) train
the digits recipe's data (1,257 training images at 16x16) with a small CNN (width 16), a
per-worker batch of 32, SGD (lr 0.05, momentum 0.9) with one warmup epoch and a cosine decay.
Every step sleeps ``--base-ms`` after its backward, standing in for a heavier model so that the
2 shared cores do not decide the result; the last rank then sleeps ``(k-1)`` times its own step
so far (the median of its last 10 steps), i.e. it is ``k`` times slower. Whole epochs, the same
samples every epoch, are timed (between barriers at the epoch's start and end, the first epoch
left out as warm-up) for

    async       strategy="async", max_staleness=None (no worker ever waits)
    async_ssp   strategy="async", max_staleness=--bound (stale-synchronous)
    ps          strategy="ps", synchronous (every step waits for the slowest)

in interleaved rounds, with a control round of async and ps without a straggler (k = 1), and
printed as ``name value unit`` lines:

    async_over_sync_throughput{_P}   samples/s async / samples/s ps      goal >= 1.35 at P=2, k=2
    async_ssp{b}_over_sync_throughput{_P}
    async_over_sync_throughput_k1{_P}  the same without a straggler: what a synchronous step costs
                                     beyond waiting for the slowest (barrier, per-step collectives)
    straggler_gain{_P}               the first over the control: the gain from not waiting alone
    async_over_sync_ideal{_P}        (P-1+1/k) / (P/k): every worker busy vs all at the slow pace
    staleness_mean{_P}               updates a shard applied between a gradient's pull and its push
    staleness_mean_over_P_minus_1{_P}  that over P-1 (1 when all workers are equally fast)
    test_acc_async{_P}, test_acc_ps{_P}  final accuracy on the 270 held-out digits, side by side

(no suffix for P=2, ``_P3`` for P=3). A shared machine is noisy: the ratios of interleaved runs
are the result, not the samples per second.

    python benchmarks/stragglers.py           # P = 2 and 3, 3 rounds, 5 epochs (~5 min on 2 cores)
    python benchmarks/stragglers.py --quick   # P = 2, 1 round, 3 epochs (< 1 min)
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, median


def _fit(name: str, world: int, k: float, base_ms: float, epochs: int, bound: int) -> dict[str, float]:
    """One Lightning fit + test; rank 0's measurements, returned through callback_metrics."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import lightning_strategies  # noqa: F401
    from lightning_strategies.comm.async_ps import AsyncParameterShard
    from lightning_strategies.comm.ps import local_shard
    from lightning_strategies.scaling import ScalingConfig
    from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy
    from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule
    from recipes.models import build_model

    class Straggle(pl.Callback):
        """Base sleep on every rank, and the last rank k times slower; epoch timing and counts."""

        def __init__(self) -> None:
            self.start = 0.0
            self.samples = 0
            self.epoch_start = 0.0
            self.times: list[float] = []
            self.counts: list[float] = []
            self.own: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.start = time.perf_counter()
            self.samples += len(batch[0])

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            # before the push: under "ps" the slow rank's own step, not its wait for the others
            time.sleep(base_ms / 1000.0)
            if trainer.global_rank == trainer.world_size - 1:
                # k - 1 times its own recent step (the median: one noisy step is not amplified)
                self.own = [*self.own[-9:], time.perf_counter() - self.start]
                time.sleep((k - 1) * median(self.own))

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            dist.barrier()
            self.epoch_start, self.samples = time.perf_counter(), 0

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            dist.barrier()  # the epoch ends when the last worker's last step is in
            self.times.append(time.perf_counter() - self.epoch_start)
            total = torch.tensor(float(self.samples))
            dist.all_reduce(total)
            self.counts.append(float(total))

        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            shard = local_shard(trainer.global_rank)
            mine = (shard.staleness_sum, shard.pushes) if isinstance(shard, AsyncParameterShard) else (0, 0)
            parts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(parts, mine)
            pushes = sum(p for _, p in parts)
            m = trainer.callback_metrics
            m["bench/staleness_mean"] = torch.tensor(sum(s for s, _ in parts) / pushes if pushes else 0.0)
            timed = slice(1, None)  # the first epoch pays for warm-up
            m["bench/samples_per_s"] = torch.tensor(sum(self.counts[timed]) / sum(self.times[timed]))

    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=32, image_size=16, seed=0)
    module = ClassificationModule(
        build_model("small_cnn", num_classes=10, in_channels=1, width=16),
        num_classes=10,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
        scaling=ScalingConfig(rule="none", base_batch_size=32, warmup_epochs=1, decay="cosine"),
    )
    timeout = timedelta(seconds=120)
    strategy: Any
    if name == "ps":
        strategy = ParameterServerStrategy(start_method="fork", timeout=timeout)
    else:
        max_staleness = None if name == "async" else bound
        strategy = AsyncParameterServerStrategy(start_method="fork", timeout=timeout, max_staleness=max_staleness)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Straggle()],
    )
    trainer.fit(module, datamodule=data)
    out = {k.split("/")[1]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("bench/")}
    results = trainer.test(module, datamodule=data, verbose=False)
    out["test_acc"] = float(results[0]["test_acc"])
    return out


def compare(world: int, k: float, base_ms: float, epochs: int, rounds: int, bound: int) -> float:
    # (strategy, slowdown): the straggler runs, and a control without a straggler (k = 1) that
    # measures what the synchronous step costs beyond waiting (barrier, per-step collectives)
    names = (("async", k), ("async_ssp", k), ("ps", k), ("async", 1.0), ("ps", 1.0))
    runs: dict[tuple[str, float], list[dict[str, float]]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name, slowdown in names[shift:] + names[:shift]:  # no run always goes first
            runs[(name, slowdown)].append(_fit(name, world, slowdown, base_ms, epochs, bound))
    suffix = "" if world == 2 else f"_P{world}"
    rate = {n: [x["samples_per_s"] for x in runs[n]] for n in names}

    def ratio(a: tuple[str, float], b: tuple[str, float]) -> list[float]:
        return [x / y for x, y in zip(rate[a], rate[b], strict=True)]

    for name, slowdown in names:
        tag = "" if slowdown == k else f"_k{slowdown:g}"
        line(f"{name}_samples_per_s{tag}{suffix}", median(rate[(name, slowdown)]), "samples/s")
    straggled = ratio(("async", k), ("ps", k))
    control = ratio(("async", 1.0), ("ps", 1.0))
    line(f"async_over_sync_throughput{suffix}", median(straggled), "x")
    line(f"async_ssp{bound}_over_sync_throughput{suffix}", median(ratio(("async_ssp", k), ("ps", k))), "x")
    line(f"async_over_sync_throughput_k1{suffix}", median(control), "x")
    # the gain from not waiting for the straggler alone, against the ideal below
    line(f"straggler_gain{suffix}", median([a / c for a, c in zip(straggled, control, strict=True)]), "x")
    line(f"async_over_sync_ideal{suffix}", (world - 1 + 1 / k) / (world / k), "x")
    staleness = median([x["staleness_mean"] for x in runs[("async", k)]])
    line(f"staleness_mean{suffix}", staleness, "updates")
    line(f"staleness_mean_over_P_minus_1{suffix}", staleness / (world - 1), "x")
    line(f"staleness_mean_ssp{bound}{suffix}", median([x["staleness_mean"] for x in runs[("async_ssp", k)]]), "updates")
    for name in ("async", "async_ssp", "ps"):
        line(f"test_acc_{name}{suffix}", median([x["test_acc"] for x in runs[(name, k)]]), "fraction")
    return median(straggled)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="P=2, one round, 3 epochs (< 1 min)")
    parser.add_argument("--k", type=float, default=2.0, help="the slow worker's slowdown factor")
    parser.add_argument("--base-ms", type=float, default=20.0, help="sleep per step on every worker (ms)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per fit (default 5; quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    parser.add_argument("--bound", type=int, default=2, help="max_staleness of the async_ssp runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_strategies"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(header("stragglers"), flush=True)
    epochs = args.epochs or (3 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 3)
    line("slowdown_k", args.k, "x")
    for world in (2,) if args.quick else (2, 3):
        compare(world, args.k, args.base_ms, epochs, rounds, args.bound)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
