"""The Hydra app's task, shared by ``train.py`` and ``python -m recipes.app --config-path <conf>``.

:func:`task` trains one configuration and returns the number a sweeper optimises
(``optimized_metric``); :func:`exit_code` is what the process exits with after a multirun (1 when
any job failed, under every launcher). ``python -m recipes.app`` is the command a sweep job runs
when it needs a process of its own (see :func:`recipes.train.run`): it never depends on how the
sweep itself was started (``train.py``, submitit's ``_submit``, ...).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import hydra
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from recipes import report
from recipes.checks import choose_threads
from recipes.failures import full_error_wanted, mark_run, report_failure
from recipes.train import ConfigError, _in_sweep, _local_processes, run

__all__ = ["exit_code", "objective", "task"]

log = logging.getLogger(__name__)


def objective(metrics: dict[str, Any], name: str | None) -> float | None:
    """The value of ``metrics[name]`` as a float: what a sweeper (Optuna) optimises.

    A failed job gives NaN (Optuna records the trial as failed and goes on); ``name=None`` gives None.

    Raises:
        ConfigError: a run that finished without that metric, or with a non-numeric one.
    """
    if name is None:
        return None
    if metrics.get("status", "ok") != "ok":
        return math.nan
    value = metrics.get(name)
    if value is None and getattr(rank_zero_only, "rank", 0) != 0:
        return None  # a sweeper reads rank 0's; with dedicated servers only rank 0 validates
    if isinstance(value, bool) or not isinstance(value, int | float):
        numeric = sorted(k for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool))
        raise ConfigError(
            f"optimized_metric={name!r}: found {value!r} in this run's metrics: expected a number, one of "
            f"{', '.join(numeric)}. Fix: set optimized_metric to one of them (or optimized_metric=null)"
        )
    return float(value)


def task(cfg: DictConfig) -> float | None:
    """Train ``cfg`` (:func:`recipes.train.run`) and return ``cfg.optimized_metric``'s value.

    A single run that fails prints its error once, with the fix, and exits 1; the traceback goes to
    the run's log file (and to the terminal with ``HYDRA_FULL_ERROR=1``): :mod:`recipes.failures`.
    Unless ``OMP_NUM_THREADS`` is set, each process gets one torch thread per free core
    (:func:`recipes.checks.threads_per_process`).
    """
    mark_run()
    chosen = choose_threads(_local_processes(cfg))
    if chosen is not None:
        log.info(
            f"torch threads: {chosen['threads']} per process for {chosen['processes']} process(es) (cores not busy: "
            f"{chosen['busy_cores']:.1f} busy with other work); OMP_NUM_THREADS=N sets it"
        )
    try:
        return objective(run(cfg), cfg.get("optimized_metric"))
    except Exception as err:
        if _in_sweep() or full_error_wanted():
            raise  # a sweep's job failed in its report (run() handles those); or the user asked for Hydra's trace
        report_failure(err)
        raise SystemExit(1) from None


def exit_code() -> int:
    """1 when a job of the multirun that just ended failed, else 0 (a single run raises instead)."""
    return 1 if report.FAILED_JOBS else 0


@hydra.main(version_base="1.3", config_path=None, config_name="train")
def _main(cfg: DictConfig) -> float | None:
    return task(cfg)


if __name__ == "__main__":
    _main()
    sys.exit(exit_code())
