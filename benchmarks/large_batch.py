"""Issue 9, claim 3: large batches need lr scaling, warmup and LAMB — a miniature of Goyal et al.

    python benchmarks/large_batch.py            # B = 32 ... 1024, 30 epochs, ~10 min on 1 CPU thread; + PNG
    python benchmarks/large_batch.py --quick    # CI-sized: B = 32 and 1024, 2 epochs, 16 px, no PNG
    python benchmarks/large_batch.py --replot results/large_batch.txt   # redraw the PNG from a saved run

Goyal et al. (2017, *Accurate, Large Minibatch SGD*, Table 1 / Fig. 3) train ResNet-50 on
ImageNet for a fixed number of epochs at global batches of 256 ... 8k: with linear lr scaling
and a 5-epoch gradual warmup top-1 error stays flat (23.60% at 256, 23.74% at 8k); without the
warmup it rises (24.84% at 8k). LAMB (You et al. 2020) with sqrt scaling is the adaptive
alternative. This script repeats the experiment in miniature: test error on scikit-learn's
digits (1,257 train / 270 test images, 32 px) against the global batch (one CPU process, so
per-device batch = global batch) for four configurations:

* ``sgd_none``: SGD (momentum 0.9, wd 5e-4), lr 0.05 tuned at B=32, not scaled;
* ``sgd_linear``: the same lr scaled linearly, ``0.05 x B/32``, no warmup;
* ``sgd_linear_warmup``: linear scaling with gradual warmup from 0.05 over ``--warmup`` epochs;
* ``lamb_sqrt_warmup``: LAMB (wd 0.01, no decay on norms/biases), lr ``0.01 x sqrt(B/32)``, same
  warmup. The usual 2e-3 at B=256 (7.1e-4 at B=32 by the sqrt rule) left 14% test error at B=32
  after 20 epochs; of {7.1e-4, 3e-3, 1e-2} at B=32, 1e-2 matched SGD (1.1%), so it is the base.

Every run trains the same model from the same seed for the same number of *epochs* (cosine
decay to 0 after warmup), so a batch of 1024 takes one step per epoch where a batch of 32
takes 39 (drop_last): fewer, larger steps are what makes large batches hard. Prints
``test_error_<config>_B<batch> <value> %`` lines, then the table (as ``#`` lines) beside the
paper's figures, which are ImageNet top-1 errors quoted for the *shape* of the curve only.

``--quick`` trains at 16 px instead of 32 (a quarter of the convolutions' work): its
``test_error_*`` lines are a smoke run's (2 epochs at 16 px), not the full run's figures.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_strategies  # noqa: F401  (registers the names)
from benchmarks._common import header, line, pyplot, save_figure

BASE_BATCH = 32
SGD_BASE_LR = 0.05
LAMB_BASE_LR = 1e-2  # tuned a little at B=32 (module docstring); 2.8e-2 at B=256 by the sqrt rule

# Goyal et al. Table 1 / Fig. 3 (ResNet-50, ImageNet top-1 error, %), quoted for shape only.
PAPER = (
    ("256, linear + warmup", 23.60),
    ("8k, linear + warmup", 23.74),
    ("8k, linear, no warmup", 24.84),
)


@dataclass(frozen=True)
class Config:
    """One line of the figure.

    Attributes:
        name: the label used in result lines and the legend.
        optimizer: ``sgd`` or ``lamb``.
        rule: the scaling rule applied from ``BASE_BATCH``.
        warmup: whether to use gradual warmup (``--warmup`` epochs).
    """

    name: str
    optimizer: str
    rule: str
    warmup: bool


CONFIGS = (
    Config("sgd_none", "sgd", "none", warmup=False),
    Config("sgd_linear", "sgd", "linear", warmup=False),
    Config("sgd_linear_warmup", "sgd", "linear", warmup=True),
    Config("lamb_sqrt_warmup", "lamb", "sqrt", warmup=True),
)


def fit_once(
    config: Config, *, batch: int, epochs: int, warmup_epochs: float, model_name: str, image_size: int = 32
) -> float:
    """Train from seed 0 at global batch ``batch``; return the test error in percent."""
    import lightning.pytorch as pl

    from lightning_strategies.optim import Lamb
    from lightning_strategies.scaling import ScalingConfig
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule
    from recipes.models import build_model

    pl.seed_everything(0, verbose=False)
    dm = DigitsDataModule(batch_size=batch, image_size=image_size)
    model = build_model(model_name, num_classes=dm.num_classes, in_channels=dm.in_channels, width=16)
    optimizer: Any
    if config.optimizer == "lamb":
        optimizer = functools.partial(Lamb, lr=LAMB_BASE_LR, weight_decay=0.01)
    else:
        optimizer = functools.partial(torch.optim.SGD, lr=SGD_BASE_LR, momentum=0.9, weight_decay=5e-4)
    module = ClassificationModule(
        model,
        num_classes=dm.num_classes,
        optimizer=optimizer,
        scaling=ScalingConfig(
            rule=config.rule,
            base_batch_size=BASE_BATCH,
            warmup_epochs=warmup_epochs if config.warmup else 0.0,
            decay="cosine",
        ),
        no_decay_norm_bias=config.optimizer == "lamb",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_val_batches=0,  # the test split is the measurement; validation would only cost time
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    acc = float(trainer.test(module, datamodule=dm, verbose=False)[0]["test_acc"])
    return 100.0 * (1.0 - acc)


def _quiet() -> None:
    # Lightning's per-fit banners and the scaling plan would bury the result lines.
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def table(errors: dict[tuple[str, int], float], batches: list[int]) -> list[str]:
    """The result grid as markdown rows, then the paper's figures."""
    rows = ["| global batch | " + " | ".join(c.name for c in CONFIGS) + " |"]
    rows.append("| ---: | " + " | ".join("---:" for _ in CONFIGS) + " |")
    for b in batches:
        rows.append(f"| {b} | " + " | ".join(f"{errors[c.name, b]:.2f}%" for c in CONFIGS) + " |")
    rows.append("")
    rows.append("Goyal et al. Table 1 / Fig. 3, ResNet-50 ImageNet top-1 error (for shape only):")
    rows.extend(f"  {label}: {value:.2f}%" for label, value in PAPER)
    return rows


def plot(errors: dict[tuple[str, int], float], batches: list[int], path: Path, *, title: str) -> None:
    """Test error against the global batch, one line per configuration; beside it the grid as a
    table and the paper's figures (claim 3 of issue 9)."""
    plt = pyplot()
    fig, (ax, ax_table) = plt.subplots(1, 2, figsize=(10.5, 3.9), gridspec_kw={"width_ratios": [1.15, 1]})
    for config, marker in zip(CONFIGS, "osD^", strict=True):
        ax.plot(batches, [errors[config.name, b] for b in batches], marker=marker, label=config.name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch size")
    ax.set_ylabel("test error (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_table.axis("off")
    cells = [[str(b), *(f"{errors[c.name, b]:.2f}" for c in CONFIGS)] for b in batches]
    columns = ["B", "sgd\nnone", "sgd\nlinear", "sgd linear\n+ warmup", "lamb sqrt\n+ warmup"]
    grid = ax_table.table(cellText=cells, colLabels=columns, loc="upper center", cellLoc="center")
    grid.auto_set_font_size(False)
    grid.set_fontsize(8)
    grid.scale(1.0, 1.5)
    for (row, _), cell in grid.get_celld().items():
        if row == 0:
            cell.set_height(cell.get_height() * 1.6)
    ax_table.set_title("test error (%), this run: digits", fontsize=9)
    paper = "\n".join(f"{label}: {value:.2f}%" for label, value in PAPER)
    ax_table.text(
        0.5,
        0.02,
        f"Goyal et al. 2017, Table 1 / Fig. 3\nResNet-50 ImageNet top-1 error (for shape only)\n{paper}",
        ha="center",
        va="bottom",
        fontsize=8,
        transform=ax_table.transAxes,
        bbox={"boxstyle": "round", "facecolor": "whitesmoke", "edgecolor": "lightgray"},
    )
    save_figure(fig, path)


def read_results(path: Path) -> tuple[dict[tuple[str, int], float], list[int], str]:
    """The errors, batches and title of a run saved as its printed output (``--replot``)."""
    errors: dict[tuple[str, int], float] = {}
    title = ""
    for text in path.read_text().splitlines():
        if not title and text.startswith("# large batch:"):
            title = text[2:].split(" | ")[0]
        match = re.fullmatch(r"test_error_(\w+)_B(\d+) (\S+) %", text.strip())
        if match:
            errors[match[1], int(match[2])] = float(match[3])
    batches = sorted({b for _, b in errors})
    missing = [(c.name, b) for b in batches for c in CONFIGS if (c.name, b) not in errors]
    if not errors or missing:
        raise SystemExit(
            f"{path}: expected test_error_<config>_B<batch> lines for {[c.name for c in CONFIGS]} at every "
            f"batch; {'found none' if not errors else f'missing {missing}'}. Pass the output of a full run."
        )
    return errors, batches, title or "large batch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", default="32,128,256,512,1024", help="global batch sizes, comma-separated")
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run, the same at every batch size")
    parser.add_argument("--warmup", type=float, default=3.0, help="warmup epochs for the *_warmup configs")
    parser.add_argument("--model", choices=("small_cnn", "resnet18"), default="small_cnn")
    parser.add_argument("--image-size", type=int, default=None, help="digits upsampled to this (default 32; quick 16)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default results/large_batch.png)")
    parser.add_argument("--quick", action="store_true", help="CI: B = 32, 1024, 2 epochs, 16 px, no PNG unless --plot")
    parser.add_argument("--replot", type=Path, default=None, help="draw the PNG from a saved run's output; no training")
    args = parser.parse_args(argv)
    if args.replot is not None:
        saved, saved_batches, saved_title = read_results(args.replot)
        plot(
            saved, saved_batches, args.plot or Path(__file__).parent / "results" / "large_batch.png", title=saved_title
        )
        return 0
    torch.set_num_threads(1)
    _quiet()
    if args.quick:
        args.batches, args.epochs, args.warmup = "32,1024", 2, 1.0
        args.image_size = args.image_size or 16
    elif args.plot is None:
        args.plot = Path(__file__).parent / "results" / "large_batch.png"
    image_size = args.image_size or 32
    batches = sorted(int(b) for b in args.batches.split(","))
    if not args.warmup < args.epochs:
        raise SystemExit(f"--warmup {args.warmup} must be less than --epochs {args.epochs}")
    title = f"large batch: {args.model} width 16, digits {image_size} px, {args.epochs} epochs, warmup {args.warmup:g}"
    print(header(title))
    print(
        f"# base lr at B={BASE_BATCH}: SGD {SGD_BASE_LR:g} (momentum 0.9, wd 5e-4), LAMB {LAMB_BASE_LR:.3g} (wd 0.01); "
        "cosine decay; seed 0; 1 CPU thread",
        flush=True,
    )
    errors: dict[tuple[str, int], float] = {}
    start = time.perf_counter()
    for b in batches:
        for config in CONFIGS:
            t = time.perf_counter()
            errors[config.name, b] = fit_once(
                config,
                batch=b,
                epochs=args.epochs,
                warmup_epochs=args.warmup,
                model_name=args.model,
                image_size=image_size,
            )
            line(f"test_error_{config.name}_B{b}", errors[config.name, b], "%")
            print(f"#   ({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"# total {time.perf_counter() - start:.0f} s")
    for row in table(errors, batches):
        print(f"# {row}".rstrip())
    if args.plot is not None:
        plot(errors, batches, args.plot, title=title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
