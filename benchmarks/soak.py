"""Soak: every strategy trains for many epochs; does a rank's memory grow, do its steps slow down?

A leak of a few kilobytes per step (a list of per-step timings never cleared, a tensor kept
alive by a logged metric, a future per communication call) is invisible in a benchmark of a
minute and fatal in a job of a week. Each strategy (``ddp``, ``ring``, ``ps``, ``async``,
``pipeline``) fits the recipes' :class:`ClassificationModule` (a small CNN, width 16, 16x16
synthetic images, SGD lr 0.02 momentum 0.5) on 2 fork-started CPU processes (gloo, one torch
thread each) as the app would run it: a CSV logger, the strategies' per-step communication
metrics, a validation pass and a ``last.ckpt`` every epoch. Every rank records, per epoch, its
training steps' wall times (``on_train_batch_start`` to ``on_train_batch_end``: forward,
backward, communication, update) and its resident set size (``/proc/self/statm``, after a
``gc.collect()``) at the epoch's end. The first ``--warmup`` epochs are warm-up (allocator
pools, lazily built buffers, the pipeline's schedule); then:

    soak_rss_growth_<s>       (RSS at the end / RSS at the end of warm-up - 1), in %, the
                              largest over ranks                              goal < 5 %
    soak_step_drift_<s>       median step time of the last third of the epochs after warm-up
                              over that of the first third, the largest over ranks   goal <= 1.10
    soak_rss_start_mib_<s>    RSS at the end of warm-up, MiB, largest rank
    soak_rss_end_mib_<s>      RSS at the end, MiB, largest rank
    soak_rss_growth_mib_<s>   the growth in MiB, largest over ranks (a forked rank's RSS includes
                              the ~0.5 GiB of torch and Lightning it shares with its parent, so
                              the % hides a small leak; this does not)
    soak_rss_late_growth_mib_<s>  the growth over the second half of the epochs after warm-up,
                              MiB, largest over ranks: allocator pools fill up and level off
                              (~0 here), a leak keeps growing (about half the growth above)
    soak_step_ms_<s>          median step time after warm-up, ms (rank 0)
    soak_epochs_<s>           epochs trained (warm-up included)

Strategies run one after the other, each for ``--minutes / len(strategies)`` of training (the
first epoch end after the budget stops it, all ranks agreeing), or exactly ``--epochs`` epochs.
A step-time drift is only meaningful on a quiet machine: the load average is printed at the
start and the end of every strategy, and a change of load during a run shows as drift.

    python benchmarks/soak.py                         # 20 minutes: 4 per strategy
    python benchmarks/soak.py --minutes 60 --strategies ring ps
    python benchmarks/soak.py --minutes 5             # results/soak.txt: 60 s per strategy
    python benchmarks/soak.py --minutes 10 --strategies ps async  # results/soak_ps_async.txt
    python benchmarks/soak.py --epochs 30             # a fixed length instead of a time budget
    python benchmarks/soak.py --quick                 # CI: 3 short epochs each (seconds)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_average, median

STRATEGIES = ("ddp", "ring", "ps", "async", "pipeline")
RSS_GOAL_PCT = 5.0
DRIFT_GOAL = 1.10


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; elsewhere the peak, from ``resource``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _make_strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_strategies import (
        AsyncParameterServerStrategy,
        ParameterServerStrategy,
        PipelineStrategy,
        RingAllReduceStrategy,
    )

    classes = {
        "ddp": DDPStrategy,
        "ring": RingAllReduceStrategy,
        "ps": ParameterServerStrategy,
        "async": AsyncParameterServerStrategy,
        "pipeline": PipelineStrategy,
    }
    # a stuck peer fails the soak within minutes instead of hanging it
    return classes[name](start_method="fork", timeout=timedelta(minutes=5))


def _monitor(name: str, out_dir: Path, budget_s: float | None, epochs: int, warmup: int) -> Any:
    import lightning.pytorch as pl

    class SoakMonitor(pl.Callback):
        """Per rank: step wall times and RSS per epoch, written to ``<name>_rank<r>.json`` at the end."""

        def __init__(self) -> None:
            self.steps: list[list[float]] = []
            self.rss: list[int] = []
            self._t0 = 0.0
            self._start = 0.0

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._start = time.perf_counter()

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.steps.append([])

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.steps[-1].append(time.perf_counter() - self._t0)

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            gc.collect()
            self.rss.append(rss_bytes())
            epoch, elapsed = len(self.rss), time.perf_counter() - self._start
            if trainer.is_global_zero:
                step_ms = 1000 * median(self.steps[-1]) if self.steps[-1] else float("nan")
                print(
                    f"# {name} epoch {epoch}{'' if budget_s else f'/{epochs}'}: {len(self.steps[-1])} steps, "
                    f"median {step_ms:.2f} ms, RSS {self.rss[-1] / 2**20:.1f} MiB, {elapsed:.0f} s, "
                    f"load {load_average(1)}",
                    flush=True,
                )
            if budget_s is not None and epoch >= warmup + 2:
                # every rank must stop at the same epoch end: the decision is reduced over ranks
                trainer.should_stop = trainer.strategy.reduce_boolean_decision(elapsed >= budget_s, all=False)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            path = out_dir / f"{name}_rank{trainer.global_rank}.json"
            path.write_text(json.dumps({"steps": self.steps, "rss": self.rss}))

    return SoakMonitor()


def soak_one(
    name: str, *, epochs: int, budget_s: float | None, warmup: int, samples: int, limit: int | None, out_dir: Path
) -> list[dict[str, Any]]:
    """One strategy's soak on 2 processes; each rank's record (step times and RSS per epoch)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_strategies import AtomicCheckpointIO  # noqa: F401  (our strategies default to it)
    from lightning_strategies.scaling import ScalingConfig
    from recipes.classification import ClassificationModule
    from recipes.data import SyntheticDataModule
    from recipes.models import build_model

    pl.seed_everything(0, verbose=False)
    dm = SyntheticDataModule(
        batch_size=16, num_samples=samples, val_samples=128, test_samples=16, channels=3, image_size=16, num_classes=10
    )
    module = ClassificationModule(
        build_model("small_cnn", num_classes=10, in_channels=3, width=16),
        num_classes=10,
        optimizer=functools.partial(torch.optim.SGD, lr=0.02, momentum=0.5),
        scaling=ScalingConfig(rule="none"),
    )
    run_dir = out_dir / name
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_make_strategy(name),
        max_epochs=epochs if budget_s is None else -1,
        limit_train_batches=limit,
        limit_val_batches=2 if limit else 4,
        num_sanity_val_steps=0,
        logger=CSVLogger(str(run_dir)),
        log_every_n_steps=10,
        callbacks=[
            _monitor(name, out_dir, budget_s, epochs, warmup),
            ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    trainer.fit(module, datamodule=dm)
    return [json.loads((out_dir / f"{name}_rank{r}.json").read_text()) for r in range(2)]


def summarise(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """RSS growth and step-time drift after ``warmup`` epochs, the worst rank's (see the module doc)."""
    growth, growth_mib, late_mib, drift, start, end = [], [], [], [], [], []
    for rec in records:
        rss, steps = rec["rss"], rec["steps"]
        if len(rss) < warmup + 2:
            raise SystemExit(f"soak: {len(rss)} epochs trained, need at least warm-up {warmup} + 2; raise --epochs")
        start.append(rss[warmup - 1])
        end.append(rss[-1])
        growth.append(100.0 * (rss[-1] / rss[warmup - 1] - 1.0))
        growth_mib.append((rss[-1] - rss[warmup - 1]) / 2**20)
        middle = warmup - 1 + (len(rss) - warmup) // 2
        late_mib.append((rss[-1] - rss[middle]) / 2**20)
        after = steps[warmup:]
        third = max(1, len(after) // 3)
        first = [t for epoch in after[:third] for t in epoch]
        last = [t for epoch in after[-third:] for t in epoch]
        drift.append(statistics.median(last) / statistics.median(first))
    return {
        "rss_growth": max(growth),
        "step_drift": max(drift),
        "rss_start_mib": max(start) / 2**20,
        "rss_end_mib": max(end) / 2**20,
        "rss_growth_mib": max(growth_mib),
        "rss_late_growth_mib": max(late_mib),
        "step_ms": 1000 * statistics.median([t for epoch in records[0]["steps"][warmup:] for t in epoch]),
        "epochs": float(len(records[0]["rss"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--minutes", type=float, default=20.0, help="training time of all strategies together")
    parser.add_argument("--epochs", type=int, default=None, help="a fixed epoch count per strategy instead")
    parser.add_argument("--warmup", type=int, default=2, help="epochs before the RSS and step-time baselines")
    parser.add_argument("--samples", type=int, default=1024, help="training images per epoch (32 steps of 2x16)")
    parser.add_argument("--quick", action="store_true", help="CI: 3 epochs of 6 steps each, 1 of warm-up")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # Lightning's hints on small data and workers
    limit = None
    budget_s: float | None = None
    if args.quick:
        args.epochs, args.warmup, limit = 3, 1, 6
    if args.epochs is None:
        budget_s = 60.0 * args.minutes / len(args.strategies)
    epochs = args.epochs or -1
    if args.epochs is not None and args.epochs < args.warmup + 2:
        parser.error(f"--epochs {args.epochs}: need at least --warmup {args.warmup} + 2 epochs")
    length = f"{budget_s:.0f} s each" if budget_s else f"{args.epochs} epochs each"
    print(header(f"soak: {', '.join(args.strategies)}, 2 CPU processes, {length}, warm-up {args.warmup} epochs"))
    print(f"# goals: soak_rss_growth < {RSS_GOAL_PCT:g} %, soak_step_drift <= {DRIFT_GOAL:.2f}", flush=True)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        for name in args.strategies:
            print(f"# {name}: start, load {load_average(1)}", flush=True)
            t = time.perf_counter()
            records = soak_one(
                name,
                epochs=epochs,
                budget_s=budget_s,
                warmup=args.warmup,
                samples=args.samples,
                limit=limit,
                out_dir=Path(tmp),
            )
            results[name] = summarise(records, args.warmup)
            print(f"# {name}: done in {time.perf_counter() - t:.0f} s, load {load_average(1)}", flush=True)
    for name, r in results.items():
        line(f"soak_rss_growth_{name}", r["rss_growth"], "%")
        line(f"soak_step_drift_{name}", r["step_drift"], "x")
        line(f"soak_rss_start_mib_{name}", r["rss_start_mib"], "MiB")
        line(f"soak_rss_end_mib_{name}", r["rss_end_mib"], "MiB")
        line(f"soak_rss_growth_mib_{name}", r["rss_growth_mib"], "MiB")
        line(f"soak_rss_late_growth_mib_{name}", r["rss_late_growth_mib"], "MiB")
        line(f"soak_step_ms_{name}", r["step_ms"], "ms")
        line(f"soak_epochs_{name}", r["epochs"], "epochs")
    over = [n for n, r in results.items() if r["rss_growth"] >= RSS_GOAL_PCT or r["step_drift"] > DRIFT_GOAL]
    print(f"# over a goal: {', '.join(over) if over else 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
