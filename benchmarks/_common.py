"""Shared by the benchmark scripts: the header line, ``name value unit`` output and the load average."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def header(title: str) -> str:
    """One line naming what ran where: machine, cores, versions, date (STYLE.md §12)."""
    import lightning

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"# {title} | {cpu}, {os.cpu_count()} cores, {gpu} | torch {torch.__version__}, lightning "
        f"{lightning.__version__}, python {platform.python_version()} | {datetime.date.today().isoformat()}"
    )


def line(name: str, value: float, unit: str) -> str:
    """A result line, ``name value unit``, as every benchmark prints them."""
    text = f"{name} {value:.4g} {unit}"
    print(text, flush=True)
    return text


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of ``values``: a measurement's own run-to-run spread; 0 for fewer than two."""
    return (max(values) - min(values)) / median(values) if len(values) > 1 else 0.0


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (creating the folder) and close ``fig``; say where it went."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"# plot: {path}", flush=True)


def load_average(digits: int = 2) -> str:
    """The machine's 1/5/15-minute load averages ("n/a" where the OS has none): ratios measured on a
    busy machine are noisy, so the benchmarks print the load beside them."""
    try:
        return " ".join(f"{x:.{digits}f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def load_line(when: str) -> str:
    """A comment line with the load average at ``when`` (``"start"``, ``"end"``)."""
    return f"# load average at {when}: {load_average()} (1/5/15 min)"


def printed_values(path: Path) -> dict[str, float]:
    """The ``name value unit`` lines of a stored output, by name (``#`` lines and others skipped)."""
    values: dict[str, float] = {}
    for text in path.read_text().splitlines():
        parts = text.split()
        if len(parts) == 3 and not text.startswith("#"):
            values[parts[0]] = float(parts[1])
    return values


def size_label(n: int) -> str:
    """``n`` elements as the lines name them: ``64K``, ``400K``, ``25.6M``."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}K"


def world_size_parser(
    doc: str | None, *, quick: str, procs: list[int], sizes: list[float], reps: int, timeout: float, n: str
) -> argparse.ArgumentParser:
    """The options of a benchmark that times P fork-started processes on N float32 elements, interleaved:
    ``--quick`` (its help ``quick``), ``--procs``, ``--sizes`` (``n``: what N counts), ``--reps``, ``--warmup``,
    ``--timeout``, with these defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--procs", type=int, nargs="+", default=procs, help="world sizes P")
    parser.add_argument("--sizes", type=float, nargs="+", default=sizes, help=f"float32 {n} N")
    parser.add_argument("--reps", type=int, default=reps, help="timed repetitions per method (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per world size")
    return parser
