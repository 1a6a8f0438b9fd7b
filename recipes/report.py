"""Turn a sweep directory of runs into ``summary.md`` and PNG plots.

``ls-report multirun/2026-11-29/10-00-00`` or ``python -m recipes.report ...``, from any directory
once the package is installed (also run automatically at the end of every Hydra multirun by
:class:`SweepReport`). It needs only Hydra's callback base, OmegaConf and matplotlib, not
``lightning_strategies`` nor torch. Each job directory holds the ``metrics.json``
that ``recipes.train.run`` wrote (or a failed one); the table has one row per job, failed jobs
included with their error, and one column per swept key. The plots group by the swept keys: with
one key a bar per job; with more, the last key's values along the x axis and one colour per
combination of the others (``optimizer=sgd,lamb data.batch_size=32,128``: batch sizes on the
axis, sgd and lamb side by side at each).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = ["FAILED_JOBS", "SweepReport", "collect", "main", "swept_keys", "write_report"]

# Job dirs of the last multirun in this process that failed (the app exits non-zero if any).
FAILED_JOBS: list[str] = []

COLUMNS: tuple[tuple[str, str], ...] = (
    ("status", "status"),
    ("test_acc", "test acc"),
    ("val_acc", "val acc"),
    ("train_loss", "train loss"),
    ("samples_per_s", "samples/s"),
    ("global_batch_size", "global batch"),
    ("lr", "lr"),
    ("world_size", "procs"),
    ("comm/bytes_sent", "bytes sent/step"),
    ("ps/server_bytes_max", "busiest server bytes/step"),
    ("async/staleness_mean", "staleness"),
    ("pipeline/bubble_fraction", "bubble"),
    ("seconds_to_val_acc_95", "s to 95% val"),
    ("wall_s", "wall s"),
)


def _overrides(job_dir: Path, metrics: dict[str, Any]) -> list[str]:
    if isinstance(metrics.get("overrides"), list):
        return [str(o) for o in metrics["overrides"]]
    path = job_dir / ".hydra" / "overrides.yaml"
    if path.exists():
        from omegaconf import OmegaConf

        return [str(o) for o in OmegaConf.load(path)]
    return []


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job directory below ``sweep_dir`` (a job dir has metrics.json or .hydra/).

    A job that left no ``metrics.json`` is a failed row saying so.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"sweep directory {str(root)!r} does not exist: expected a multirun directory (multirun/<date>/<time>). "
            "Fix: pass the sweep directory that `python train.py -m ...` printed"
        )
    rows = []
    # Hydra numbers job dirs 0, 1, ...: in job order (10 after 9), other names after, by name
    job_dirs = sorted(
        (p for p in root.iterdir() if p.is_dir()),
        key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name),
    )
    for job_dir in job_dirs:
        metrics_path = job_dir / "metrics.json"
        if metrics_path.exists():
            try:
                metrics = json.loads(metrics_path.read_text())
            except json.JSONDecodeError as err:
                metrics = {"status": "failed", "error": f"unreadable metrics.json: {err}"}
        elif (job_dir / ".hydra").is_dir():
            metrics = {"status": "failed", "error": "no metrics.json (the job died before writing it)"}
        else:
            continue
        metrics.setdefault("status", "ok")
        row = {"job": job_dir.name, "overrides": _overrides(job_dir, metrics), **metrics}
        rows.append(row)
    return rows


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Override keys whose values differ between jobs, in first-seen order."""
    values: dict[str, set[str]] = {}
    order: list[str] = []
    for row in rows:
        for item in row["overrides"]:
            key, _, value = item.partition("=")
            if key not in values:
                values[key] = set()
                order.append(key)
            values[key].add(value)
    for row in rows:  # a key missing in a job counts as a different value
        keys = {item.partition("=")[0] for item in row["overrides"]}
        for key in order:
            if key not in keys:
                values[key].add("<default>")
    return [k for k in order if len(values[k]) > 1]


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _why_missing(row: dict[str, Any], key: str) -> str:
    """Why ``row`` has no ``key``: the job failed, never got there, or does not measure it."""
    if row.get("status") != "ok":
        return "failed"
    if key == "seconds_to_val_acc_95" and row.get("val_acc_by_epoch"):
        return "not reached"  # validated every epoch, never at 95%
    return "n/a"  # e.g. ddp counts no bytes


def _job_value(row: dict[str, Any], key: str) -> str:
    for item in row["overrides"]:
        k, _, v = item.partition("=")
        if k == key:
            return v
    return "<default>"


def _table_missing(row: dict[str, Any], key: str) -> str:
    why = _why_missing(row, key)
    return why if why == "not reached" else "-"  # the status column already says "failed"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    keys = swept_keys(rows)
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    header = ["job", *keys, *(title for _, title in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["job"], *(_job_value(row, k) for k in keys)]
        cells += [_cell(row[key]) if row.get(key) is not None else _table_missing(row, key) for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("status") != "ok"]
    for row in failed:
        lines.append(f"\n**{row['job']} failed**: {_cell(row.get('error'))}")
    return "\n".join(lines) + "\n"


def _label(row: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(_job_value(row, k) for k in keys) or row["job"]


def _layout(rows: list[dict[str, Any]], keys: list[str]) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """Bar positions grouped by the swept keys: (x tick labels, series labels, (x, series) per row).

    One key (or none): one bar per job. More: the last key's values on the x axis, one series per
    combination of the other keys' values, both in first-seen order.
    """
    if len(keys) < 2:
        return [_label(r, keys) for r in rows], [], [(i, 0) for i in range(len(rows))]
    ticks: list[str] = []
    series: list[str] = []
    positions = []
    for row in rows:
        tick, series_label = _job_value(row, keys[-1]), _label(row, keys[:-1])
        for values, value in ((ticks, tick), (series, series_label)):
            if value not in values:
                values.append(value)
        positions.append((ticks.index(tick), series.index(series_label)))
    return ticks, series, positions


PLOTS: tuple[tuple[str, str], ...] = (
    ("test_acc", "test accuracy"),
    ("samples_per_s", "samples / s"),
    ("comm/bytes_sent", "bytes sent per step per worker"),
    ("ps/server_bytes_max", "busiest server bytes per step"),
    ("seconds_to_val_acc_95", "seconds to 95% validation accuracy"),
    ("async/staleness_mean", "mean staleness (updates)"),
    ("pipeline/bubble_fraction", "pipeline bubble fraction"),
    ("wall_s", "wall time (s)"),
)


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Bar charts of the numeric columns across jobs, grouped by the swept keys (see the module
    docstring); a job without the value is an empty bar saying why: "failed", "not reached" (time
    to 95% of a job that validated but never got there) or "n/a" (ddp counts no bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    ticks, series, positions = _layout(rows, keys)
    width = 0.8 / max(1, len(series))
    written = []
    for key, title in PLOTS:
        values = [r.get(key) if r.get("status") == "ok" else None for r in rows]
        if not any(isinstance(value, int | float) for value in values):
            continue
        fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 3.4))
        in_legend: set[int] = set()
        for (x, series_index), value, row in zip(positions, values, rows, strict=True):
            # with series, each bar sits at its group's centre plus its series' offset
            bar_x = x + (series_index - (len(series) - 1) / 2) * width if series else x
            height = float(value) if isinstance(value, int | float) else 0.0
            color = f"C{series_index}" if value is not None else "lightgray"
            label = series[series_index] if series and value is not None and series_index not in in_legend else None
            if label is not None:
                in_legend.add(series_index)
            bar = ax.bar(bar_x, height, width=width if series else 0.8, color=color, label=label)[0]
            text = _why_missing(row, key) if value is None else f"{float(value):.3g}"
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            ax.annotate(text, top, ha="center", va="bottom", fontsize=7 if series else 8)
        ax.set_xticks(
            range(len(ticks)), ticks, rotation=0 if series else 30, ha="center" if series else "right", fontsize=8
        )
        ax.set_ylabel(title)
        if series:
            ax.set_xlabel(keys[-1])
            ax.legend(title=", ".join(keys[:-1]), fontsize=7, title_fontsize=7)
        ax.set_title(f"{title} by {', '.join(keys) or 'job'}")
        ax.margins(y=0.12)  # room for the value above the tallest bar
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(sweep_dir: str | Path) -> Path:
    """Write ``summary.md`` and the plots into ``sweep_dir``; return the summary's path."""
    root = Path(sweep_dir)
    rows = collect(root)
    if not rows:
        raise FileNotFoundError(
            f"no job directories with metrics.json or .hydra/ below {str(root)!r}: expected the sweep's job "
            "directories 0, 1, ... Fix: pass the sweep directory itself (multirun/<date>/<time>), not a job's "
            "directory or the one above it"
        )
    table = markdown_table(rows)
    images = plot(rows, root)
    keys = swept_keys(rows)
    ok = sum(r.get("status") == "ok" for r in rows)
    text = f"# Sweep summary: {root}\n\n{len(rows)} jobs, {ok} ok; swept: {', '.join(keys) or '(nothing)'}\n\n{table}"
    text += "".join(f"\n![{p.stem}]({p.name})\n" for p in images)
    summary = root / "summary.md"
    summary.write_text(text)
    return summary


class SweepReport(Callback):
    """Hydra callback: after a multirun, write and print the sweep's summary, and record its
    failed jobs in :data:`FAILED_JOBS` (the app exits non-zero when there are any).

    Failures are read from the job directories, not from Hydra's job returns: under submitit a job
    runs (and its callbacks are called) in another process, and every launcher leaves the dirs.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        FAILED_JOBS.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summary = write_report(config.hydra.sweep.dir)
        FAILED_JOBS[:] = [str(row["job"]) for row in collect(config.hydra.sweep.dir) if row.get("status") != "ok"]
        print(summary.read_text(), flush=True)
        print(f"sweep summary: {summary}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("sweep_dir", help="a multirun directory (multirun/<date>/<time>)")
    args = parser.parse_args(argv)
    try:
        summary = write_report(args.sweep_dir)
    except FileNotFoundError as err:  # no sweep there: one message, not a traceback
        print(f"Error: {err}", file=sys.stderr)
        return 1
    print(summary.read_text())
    print(f"sweep summary: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
