"""Turn a sweep directory of runs into ``summary.md`` and PNG plots.

``python -m recipes.report multirun/2026-11-29/10-00-00`` (also run automatically at the end of
every Hydra multirun by :class:`SweepReport`). Each job directory holds the ``metrics.json``
that ``recipes.train.run`` wrote (or a failed one); the table has one row per job, failed jobs
included with their error, and one column per swept key.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = ["FAILED_JOBS", "SweepReport", "collect", "main", "swept_keys", "write_report"]

# Jobs of the last multirun in this process that failed (train.py exits non-zero if any).
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
        raise FileNotFoundError(f"sweep directory {str(root)!r} does not exist; pass the multirun/<date>/<time> dir")
    rows = []
    for job_dir in sorted(p for p in root.iterdir() if p.is_dir()):
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


def _job_value(row: dict[str, Any], key: str) -> str:
    for item in row["overrides"]:
        k, _, v = item.partition("=")
        if k == key:
            return v
    return "<default>"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    keys = swept_keys(rows)
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    header = ["job", *keys, *(title for _, title in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["job"], *(_job_value(row, k) for k in keys)]
        cells += [_cell(row.get(key)) for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("status") != "ok"]
    for row in failed:
        lines.append(f"\n**{row['job']} failed**: {_cell(row.get('error'))}")
    return "\n".join(lines) + "\n"


def _label(row: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(_job_value(row, k) for k in keys) or row["job"]


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Bar charts of the numeric columns across jobs (failed jobs shown as empty bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    labels = [_label(r, keys) for r in rows]
    written = []
    for key, title in (
        ("test_acc", "test accuracy"),
        ("samples_per_s", "samples / s"),
        ("comm/bytes_sent", "bytes sent per step per worker"),
        ("ps/server_bytes_max", "busiest server bytes per step"),
        ("seconds_to_val_acc_95", "seconds to 95% validation accuracy"),
        ("async/staleness_mean", "mean staleness (updates)"),
        ("pipeline/bubble_fraction", "pipeline bubble fraction"),
        ("wall_s", "wall time (s)"),
    ):
        values = [r.get(key) if r.get("status") == "ok" else None for r in rows]
        if not any(isinstance(v, int | float) for v in values):
            continue
        fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 3.2))
        heights = [float(v) if isinstance(v, int | float) else 0.0 for v in values]
        bars = ax.bar(range(len(rows)), heights, color=["C0" if v is not None else "lightgray" for v in values])
        for bar, v, row in zip(bars, values, rows, strict=True):
            # a failed job, or a job that does not measure this (ddp counts no bytes)
            text = ("failed" if row.get("status") != "ok" else "n/a") if v is None else f"{float(v):.3g}"
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            ax.annotate(text, top, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(title)
        ax.set_title(f"{title} by {', '.join(keys) or 'job'}")
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
        raise FileNotFoundError(f"no job directories with metrics.json or .hydra/ below {str(root)!r}")
    table = markdown_table(rows)
    images = plot(rows, root)
    text = f"# Sweep summary: {root}\n\n{len(rows)} jobs, {sum(r.get('status') == 'ok' for r in rows)} ok\n\n{table}"
    text += "".join(f"\n![{p.stem}]({p.name})\n" for p in images)
    summary = root / "summary.md"
    summary.write_text(text)
    return summary


class SweepReport(Callback):
    """Hydra callback: after a multirun, write and print the sweep's summary."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        FAILED_JOBS.clear()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        value = getattr(job_return, "_return_value", None)
        failed = getattr(job_return.status, "name", "") == "FAILED" or (
            isinstance(value, dict) and value.get("status") == "failed"
        )
        if failed:
            FAILED_JOBS.append(str(getattr(job_return, "working_dir", "?")))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summary = write_report(config.hydra.sweep.dir)
        print(summary.read_text(), flush=True)
        print(f"sweep summary: {summary}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("sweep_dir", help="a multirun directory (multirun/<date>/<time>)")
    args = parser.parse_args(argv)
    summary = write_report(args.sweep_dir)
    print(summary.read_text())
    print(f"sweep summary: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
