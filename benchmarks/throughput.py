"""Training throughput of one strategy against another on the same recipe, side by side.

    python benchmarks/throughput.py --strategy ring --vs ddp            # digits, 2 CPU processes
    python benchmarks/throughput.py --strategy ring --vs ddp --quick    # CI-sized

Each round fits the digits recipe (narrow ResNet-18, the same seed and data) once with each
strategy, interleaved A, B, A, B so that machine noise hits both alike; processes are
fork-started. samples/s is the median over rounds of each fit's epochs after the first
(warm-up). Prints ``name value unit`` lines and ``{a}_over_{b}`` (goal for ring/ddp: >= 0.95).
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

import lightning_strategies  # noqa: F401  (registers the names)
from benchmarks._common import header, line, load_line, median


def make_strategy(name: str, **overrides: Any) -> Any:
    """A registered strategy by name, fork-started when it accepts ``start_method``."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    if name == "ddp":
        return DDPStrategy(start_method="fork", **overrides)
    if name not in StrategyRegistry:
        raise SystemExit(f"unknown strategy {name!r}; registered: {', '.join(sorted(StrategyRegistry))}")
    entry = StrategyRegistry[name]
    params = {**entry["init_params"], **overrides}
    try:
        return entry["strategy"](start_method="fork", **params)
    except TypeError:
        return entry["strategy"](**params)


def fit_once(strategy_name: str, *, devices: int, epochs: int, limit_batches: int | None, data: str) -> float:
    import lightning.pytorch as pl

    from lightning_strategies.scaling import ScalingConfig
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule, SyntheticDataModule
    from recipes.models import build_model

    pl.seed_everything(0, verbose=False)
    dm = DigitsDataModule(batch_size=64) if data == "digits" else SyntheticDataModule(batch_size=64, num_samples=1024)
    model = build_model("resnet18", num_classes=dm.num_classes, in_channels=dm.in_channels, width=16)
    module = ClassificationModule(
        model,
        num_classes=dm.num_classes,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
        scaling=ScalingConfig(rule="linear", base_batch_size=64),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(strategy_name),
        max_epochs=epochs,
        limit_train_batches=limit_batches,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_throughput()],
    )
    trainer.fit(module, datamodule=dm)
    return float(trainer.callback_metrics["throughput/samples_per_s"])


def _throughput() -> Any:
    from recipes.classification import EpochThroughputMonitor

    return EpochThroughputMonitor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strategy", default="ring", help="registered strategy name (ring, ps, ...)")
    parser.add_argument("--vs", default="ddp", help="the reference strategy")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="per fit; the first is warm-up")
    parser.add_argument("--data", choices=("digits", "synthetic"), default="digits")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 short epochs (CI)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    limit = None
    if args.quick:
        args.rounds, args.epochs, limit = 1, 2, 4
    print(header(f"throughput: {args.strategy} vs {args.vs}, {args.devices} CPU processes, {args.data}"))
    print(load_line("start"), flush=True)
    rates: dict[str, list[float]] = {args.strategy: [], args.vs: []}
    for r in range(args.rounds):
        order = (args.strategy, args.vs) if r % 2 == 0 else (args.vs, args.strategy)
        for name in order:
            t = time.perf_counter()
            rates[name].append(
                fit_once(name, devices=args.devices, epochs=args.epochs, limit_batches=limit, data=args.data)
            )
            print(f"# round {r} {name}: {rates[name][-1]:.1f} samples/s ({time.perf_counter() - t:.0f} s)", flush=True)
    a, b = median(rates[args.strategy]), median(rates[args.vs])
    line(f"{args.strategy}_samples_per_s", a, "samples/s")
    line(f"{args.vs}_samples_per_s", b, "samples/s")
    line(f"{args.strategy}_over_{args.vs}", a / b, "x")
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
