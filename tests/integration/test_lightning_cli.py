"""LightningCLI with every strategy of this package: by name, by class path (with and without
options, on the command line and in YAML), and a fit through the example script of docs/quickstart.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from app_utils import ROOT, pythonpath

import lightning_strategies
from lightning_strategies.strategies._registry import STRATEGY_ROWS

pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI

EXAMPLE = ROOT / "examples" / "cli"
sys.path.insert(0, str(EXAMPLE))
from cli_fit import RandomData, Regressor  # noqa: E402

BASE = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"]

# class -> options a user might pass, and the attribute that shows they arrived
CLASS_OPTIONS: dict[type, tuple[dict[str, Any], str]] = {
    lightning_strategies.RingAllReduceStrategy: ({"wire_dtype": "bf16", "bucket_cap_mb": 10}, "wire_dtype"),
    lightning_strategies.ParameterServerStrategy: ({"num_servers": 1}, "num_servers"),
    lightning_strategies.RingParameterServerStrategy: ({"bucket_cap_mb": 10, "overlap": False}, "bucket_cap_mb"),
    lightning_strategies.AsyncParameterServerStrategy: ({"num_servers": 1, "max_staleness": 2}, "num_servers"),
    lightning_strategies.PipelineStrategy: ({"schedule": "gpipe", "num_stages": 2}, "num_stages"),
    lightning_strategies.TensorParallelStrategy: ({"tp_size": 2}, "tp_size"),
}


def _cli(args: list[str]) -> LightningCLI:
    return LightningCLI(Regressor, RandomData, run=False, args=[*BASE, *args])


@pytest.mark.parametrize("row", STRATEGY_ROWS, ids=lambda r: r.name)
def test_every_strategy_name(row: Any) -> None:
    cli = _cli([f"--trainer.strategy={row.name}"])
    assert type(cli.trainer.strategy) is row.strategy_class()


@pytest.mark.parametrize("cls", list(CLASS_OPTIONS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("with_options", [False, True])
def test_every_strategy_by_class_path(cls: type, with_options: bool) -> None:
    # jsonargparse passes every DDP option at its default value: those must not be refused
    options, attribute = CLASS_OPTIONS[cls]
    path = f"lightning_strategies.{cls.__name__}"
    if with_options:
        args = [f"--trainer.strategy={path}", *(f"--trainer.strategy.{k}={v}" for k, v in options.items())]
    else:  # a bare --trainer.strategy=<path> is read as a strategy name (Lightning's own DDPStrategy too)
        args = [f"--trainer.strategy.class_path={path}"]
    strategy = _cli(args).trainer.strategy
    assert type(strategy) is cls
    if with_options:
        value = getattr(strategy, attribute, getattr(strategy, f"_{attribute}", None))
        assert str(value) == str(options[attribute]) or value == options[attribute], (attribute, value)


def test_class_path_in_yaml() -> None:
    strategy = _cli([f"--config={EXAMPLE / 'ps.yaml'}"]).trainer.strategy
    assert type(strategy) is lightning_strategies.ParameterServerStrategy
    assert strategy.num_servers == 1


def test_a_ddp_wrapper_option_that_is_set_is_still_refused() -> None:
    with pytest.raises((TypeError, ValueError), match=r"got \['find_unused_parameters'\]: expected its own options"):
        _cli(["--trainer.strategy=lightning_strategies.ParameterServerStrategy",
              "--trainer.strategy.find_unused_parameters=true"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["--trainer.strategy=lightning_strategies.ParameterServerStrategy", "--trainer.strategy.num_servers=1",
         "--trainer.strategy.start_method=fork"],
        ["--trainer.strategy=ring"],
    ],
    ids=["ps_class_path", "ring_name"],
)
def test_the_example_fits(strategy: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath()}
    command = [sys.executable, str(EXAMPLE / "cli_fit.py"), "fit", *BASE, "--trainer.max_epochs=1",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}", *strategy]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in proc.stdout + proc.stderr
