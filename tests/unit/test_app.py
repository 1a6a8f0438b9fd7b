"""The app's pieces as a user of Hydra, Lightning and Fabric meets them: the sweep objective, where a
sweep job runs, bring-your-own modules, device messages, the report's imports, Fabric's refusal."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from app_utils import ROOT, compose_cfg, pythonpath
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from torch import nn

from lightning_strategies.scaling import ScalingConfig
from recipes.app import objective
from recipes.classification import ClassificationModule
from recipes.train import ConfigError, _check_devices, _job_needs_own_process, build_module

SLURM_ENV = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NODELIST": "node0"}
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_objective_is_the_optimized_metric_as_a_float() -> None:
    metrics = {"status": "ok", "val_acc": 0.75, "test_acc": 0.5, "strategy": "ring", "val_loss": None}
    assert objective(metrics, "val_acc") == 0.75 and isinstance(objective(metrics, "val_acc"), float)
    assert objective(metrics, None) is None
    assert math.isnan(objective({"status": "failed", "error": "boom"}, "val_acc"))  # Optuna: a failed trial
    with pytest.raises(ConfigError, match=r"optimized_metric='val_f1': found None .* expected a number, one of "
                                          r"test_acc, val_acc\. Fix: set optimized_metric"):
        objective(metrics, "val_f1")


@pytest.mark.parametrize(
    ("overrides", "env", "own_process"),
    [
        ([], {}, False),  # one process: runs where the launcher put it
        (["trainer=ddp_sim"], {}, True),  # Lightning would re-run the command line for rank 1
        (["trainer=ddp_sim", "strategy=single"], {}, False),
        (["trainer=ddp_sim", "strategy=ring", "strategy.start_method=fork"], {}, False),  # forks, re-runs nothing
        (["trainer=ddp_sim", "strategy=ring"], SLURM_ENV, False),  # srun started every rank: SLURMEnvironment
        (["trainer=ddp_sim", "strategy=ps"], TORCHRUN_ENV, False),  # torchrun started every rank
    ],
    ids=["single", "ddp_sim", "single_in_ddp_sim", "fork", "slurm", "torchrun"],
)
def test_where_a_sweep_job_runs(
    overrides: list[str], env: dict[str, str], own_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [*SLURM_ENV, *TORCHRUN_ENV]:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _job_needs_own_process(compose_cfg(overrides)) is own_process


def test_cpu_processes_above_the_cores_warn_as_lightning_runs_them() -> None:
    with pytest.warns(UserWarning, match=r"trainer.devices=4096 CPU processes on \d+ cores: they share the cores"):
        _check_devices("cpu", 4096)
    with pytest.raises(ConfigError, match=r"trainer\.devices must be >= 1, found 0"):
        _check_devices("cpu", 0)


def test_gpu_without_cuda_says_how_to_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"found no CUDA device on this machine: expected at least one GPU for "
                                          r"trainer=gpu\. Fix: run on the CPU with trainer=cpu .*trainer=ddp_sim"):
        _check_devices("gpu", 1)
    if not torch.cuda.is_available():  # the whole app, as `python train.py trainer=gpu` runs it
        from recipes.train import run

        with pytest.raises(ConfigError, match="found no CUDA device"):
            run(compose_cfg(["trainer=gpu"], output_dir=tmp_path))


def _module(target: str, datamodule: pl.LightningDataModule, **extra: object) -> pl.LightningModule:
    from omegaconf import OmegaConf

    node = OmegaConf.create({"_target_": target, **extra})
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    scaling = ScalingConfig(rule="linear", base_batch_size=32)
    plan = scaling.plan(base_lr=0.1, per_device=64, replicas=2, accumulate=1)
    return build_module(node, datamodule, optimizer=optimizer, scaling=scaling, plan=plan)


class TakesThePlan(BoringModel):
    def __init__(self, *, optimizer: object, plan: object, width: int = 4) -> None:
        super().__init__()
        self.given = (optimizer, plan, width)


def test_any_lightning_module_or_network_through_target() -> None:
    data = BoringDataModule()
    # a LightningModule class, no _partial_: used as it is
    boring = _module("lightning.pytorch.demos.boring_classes.BoringModel", data)
    assert type(boring) is BoringModel
    # _partial_: called with the offered arguments its signature names (and not those the config fixes)
    taker = _module(f"{__name__}.TakesThePlan", data, _partial_=True, width=8)
    assert isinstance(taker, TakesThePlan)
    optimizer, plan, width = taker.given
    assert plan.lr == pytest.approx(0.1 * 128 / 32) and optimizer.func is torch.optim.SGD and width == 8
    # a network factory: trained by the classification wrapper, which needs the data's num_classes
    data.num_classes, data.in_channels = 10, 3  # type: ignore[attr-defined]
    wrapped = _module("recipes.models.build_model", data, _partial_=True, name="small_cnn", width=8)
    assert isinstance(wrapped, ClassificationModule) and isinstance(wrapped.model, nn.Module)


def test_a_network_without_num_classes_or_something_else_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"needs num_classes from the data: found BoringDataModule without "
                                          r"num_classes\. Fix: give the DataModule num_classes attributes"):
        _module("recipes.models.build_model", BoringDataModule(), _partial_=True, name="small_cnn")
    with pytest.raises(ConfigError, match=r"builds a bare network.*found BoringDataModule without an int "
                                          r"num_classes\. Fix: give the DataModule num_classes"):
        _module("recipes.models.small_cnn", BoringDataModule(), _partial_=True, num_classes=3)
    with pytest.raises(ConfigError, match=r"built a Linear: expected a LightningModule.*Fix: point model._target_"):
        _module("torch.nn.Linear", BoringDataModule(), in_features=2, out_features=2)


def test_report_imports_neither_torch_nor_the_library() -> None:
    code = "import sys, recipes.report; print(sorted({'torch', 'lightning_strategies'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": pythonpath(), "PATH": ""}, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_fabric_refuses_our_names_clearly() -> None:
    from lightning.fabric import Fabric

    import lightning_strategies  # noqa: F401  (registers the names)

    for name in ("ring", "ps", "async", "pipeline"):
        with pytest.raises(ValueError, match=rf"Fabric\(strategy='{name}'\): found a lightning-strategies strategy, "
                                             rf"which is a Trainer strategy.*Fix: train with lightning\.pytorch\."
                                             rf"Trainer\(strategy='{name}'\)"):
            Fabric(strategy=name, accelerator="cpu", devices=1)
    assert ROOT.is_dir()
