"""Compose the app's Hydra config in-process, and run train.py as its own process.

``run_train`` runs ``python train.py ARGS`` as a process of its own, forked from a zygote that imported the
app once per test process (``fault_utils.run_forked``: the imports cost ~5 s of CPU a run on 2 cores, 10 s
loaded), where ``train.py`` runs as ``__main__`` with a fresh interpreter's ``sys.path`` and ``PYTHONPATH``;
the ranks a launcher starts from it (Lightning's ``popen``, a sweep's jobs) are fresh interpreters as
before. ``fresh=True`` starts a fresh interpreter for the run itself: what a user's first ``python
train.py`` does, imports included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fault_utils import run_forked
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import recipes.train  # noqa: F401  (registers the torch_device resolver)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A few batches per stage: enough to run every hook, quick on 2 cores.
FEW_BATCHES = [
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "+trainer.limit_test_batches=1",
    "trainer.enable_progress_bar=false",
]


def compose_cfg(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    if output_dir is not None:
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.output_dir = str(output_dir)
    return cfg


def config_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def pythonpath(*paths: Path | str) -> str:
    """``paths``, the repository root (recipes, for processes a launcher starts) and the inherited PYTHONPATH."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([*(str(p) for p in paths), str(ROOT), *inherited])


def run_train(
    args: list[str],
    cwd: Path,
    timeout: float = 300,
    extra_paths: tuple[Path, ...] = (),
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python train.py ARGS`` from ``cwd`` (outputs land there), one torch thread per process;
    ``extra_paths`` go on the PYTHONPATH (modules a config's ``_target_`` names), ``env`` on top. Forked
    from the test process's app zygote (module doc); ``fresh``: a fresh interpreter. Past ``timeout``
    the run and every process it started are killed and ``subprocess.TimeoutExpired`` raised."""
    # PYTHONFAULTHANDLER: a process that dies of a signal prints every thread's Python stack to stderr (an ft
    # launcher died of SIGSEGV three times in full suites while torchft's Lighthouse server ran inside it; the
    # Lighthouse now runs as its own process: start_lighthouse)
    extra = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    command = [sys.executable, str(ROOT / "train.py"), *args]
    if not fresh:
        return run_forked(command[1], args, cwd=cwd, timeout=timeout, pythonpath=pythonpath(*extra_paths), env=extra)
    full_env = {**os.environ, "PYTHONPATH": pythonpath(*extra_paths), **extra}
    # its own process group, so a timeout ends the ranks and sweep jobs it started too
    with subprocess.Popen(
        command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
