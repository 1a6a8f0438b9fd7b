"""Every config group option composes and builds; bad input stops before training, clearly."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from app_utils import compose_cfg, config_options
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from lightning_strategies import AtomicCheckpointIO, PeerFailureReport
from lightning_strategies.scaling import ScalingConfig
from recipes.classification import EpochThroughputMonitor
from recipes.train import ConfigError, build_callbacks, run

GROUPS = ["data", "model", "optimizer", "scaling", "strategy", "trainer", "logger", "callbacks", "recipe"]


@pytest.mark.parametrize(
    ("group", "option"), [(g, o) for g in GROUPS for o in config_options(g)], ids=lambda v: str(v)
)
def test_every_option_composes_and_builds(group: str, option: str, tmp_path: Path) -> None:
    overrides = [f"{group}={option}"]
    if option == "imagefolder" or (group == "recipe" and "imagenet" in option):
        _tree(tmp_path)
        overrides.append(f"data.root={tmp_path}")
    cfg = compose_cfg(overrides)
    if group == "recipe":
        return  # a recipe only overrides the other groups; composing it is the check
    if group == "callbacks":
        callbacks = build_callbacks(cfg, tmp_path)
        assert len(callbacks) == len(cfg.callbacks) and all(isinstance(c, pl.Callback) for c in callbacks)
        return
    obj = instantiate(cfg[group])
    if group == "model":
        model = obj(num_classes=10, in_channels=3)
        assert isinstance(model, torch.nn.Module)
    elif group == "optimizer":
        opt = obj([torch.nn.Parameter(torch.zeros(3))])
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == cfg.optimizer.lr
    elif group == "scaling":
        assert isinstance(obj, ScalingConfig) and obj.rule == option
    elif group in ("trainer", "logger"):
        assert isinstance(obj, functools.partial)
    elif group == "data":
        assert obj.batch_size == cfg.data.batch_size
    else:
        from lightning.pytorch.strategies import Strategy

        assert isinstance(obj, Strategy)


def _tree(root: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8)).save(root / split / f"c{c}" / "0.png")


def test_recipe_overrides_and_command_line_wins() -> None:
    goyal = compose_cfg(["recipe=resnet50_imagenet_goyal", "data.root=/x"])
    assert goyal.global_batch_size == 8192 and goyal.scaling.warmup_epochs == 5
    assert list(goyal.scaling.milestones) == [30, 60, 80] and goyal.model.name == "resnet50"
    # a group named on the command line beats the recipe's and the trainer's choice
    cfg = compose_cfg(["trainer=ddp_sim", "strategy=single"])
    assert cfg.strategy._target_.endswith("SingleDeviceStrategy") and cfg.trainer.devices == 2
    assert compose_cfg(["trainer=ddp_sim"]).strategy._target_.endswith("DDPStrategy")


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(MissingConfigException) as err:
        compose_cfg(["strategy=nope"])
    text = str(err.value)
    assert "strategy/nope" in text and "ddp" in text and "single" in text


BAD_INPUT = [
    (["optimizer.lr=-0.1"], ConfigError, r"optimizer.lr must be a positive number, found -0.1"),
    (["optimizer.lr=0"], ConfigError, r"optimizer.lr must be a positive number, found 0"),
    (
        ["data.batch_size=0"],
        ValueError,
        r"data.batch_size is the per-device batch and must be a positive integer, found 0",
    ),
    (["trainer.max_epochs=0"], ConfigError, r"trainer.max_epochs must be a positive integer, found 0"),
    (
        ["trainer=ddp_sim", "global_batch_size=101"],
        ConfigError,
        r"global batch 101 is not divisible by 2 replicas x 1 accumulation steps",
    ),
    (
        ["data=imagefolder", "data.root=/no/such/dir"],
        FileNotFoundError,
        r"ImageFolder root '/no/such/dir' lacks train/",
    ),
    (["scaling.rule=cubic"], ValueError, r"unknown scaling rule 'cubic'; expected one of none, linear, sqrt"),
    (["data.num_workers=0", "data.prefetch_factor=2"], ValueError, r"prefetch_factor=2 needs loader workers"),
    (
        ["resume=/no/such.ckpt"],
        ConfigError,
        r"resume='/no/such.ckpt': no checkpoint file at /no/such.ckpt; expected a .ckpt written by an earlier run",
    ),
    (["resume=/"], ConfigError, r"no checkpoint file at / \(it is a directory\).*Fix: set resume=<path to the .ckpt>"),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_INPUT, ids=lambda v: str(v))
def test_bad_input_stops_before_training(
    overrides: list[str], error: type[Exception], message: str, tmp_path: Path
) -> None:
    cfg = compose_cfg(overrides, output_dir=tmp_path)
    with pytest.raises(error, match=message):
        run(cfg)
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("overrides", "momentum"),
    [
        (["strategy=async", "trainer=ddp_sim"], 0.5),  # conf/strategy_optimizer/async_sgd.yaml
        (["strategy=async_elastic", "trainer=ddp_sim"], 0.5),  # async_elastic_sgd.yaml
        (["strategy=async", "optimizer.momentum=0.8"], 0.8),  # the command line still wins
        (["strategy=async", "optimizer=lamb"], None),  # no async_lamb.yaml: Lamb has no momentum key
        (["strategy=ddp", "trainer=ddp_sim"], 0.9),  # only async is specialised
    ],
)
def test_async_sgd_gets_a_lower_momentum(overrides: list[str], momentum: float | None) -> None:
    # asynchrony adds ~1 - 1/P implicit momentum; SGD's 0.9 on top diverges the digits ResNet
    assert compose_cfg(overrides).optimizer.get("momentum") == momentum


def _types(callbacks: list[pl.Callback]) -> list[type]:
    return [type(c) for c in callbacks]


def test_default_callbacks_and_checkpoint_io(tmp_path: Path) -> None:
    cfg = compose_cfg([])
    callbacks = build_callbacks(cfg, tmp_path)
    assert _types(callbacks) == [EpochThroughputMonitor, LearningRateMonitor, PeerFailureReport, ModelCheckpoint]
    checkpoint = callbacks[-1]
    assert isinstance(checkpoint, ModelCheckpoint)
    assert checkpoint.dirpath == str(tmp_path / "checkpoints") and checkpoint.save_last and checkpoint.save_top_k == 0
    for trainer in config_options("trainer"):
        plugins = instantiate(compose_cfg([f"trainer={trainer}"]).trainer).keywords["plugins"]
        assert _types(plugins) == [AtomicCheckpointIO], trainer
    assert instantiate(compose_cfg(["trainer.plugins=[]"]).trainer).keywords["plugins"] == []


def test_callbacks_dropped_and_overridden_from_the_command_line(tmp_path: Path) -> None:
    cfg = compose_cfg(
        ["~callbacks.learning_rate_monitor", "callbacks.model_checkpoint.save_top_k=2",
         "+callbacks.model_checkpoint.monitor=val_acc", "+callbacks.model_checkpoint.mode=max",
         f"callbacks.model_checkpoint.dirpath={tmp_path / 'mine'}",
         "+callbacks.early_stopping={_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val_loss}"]
    )
    callbacks = build_callbacks(cfg, tmp_path)
    assert LearningRateMonitor not in _types(callbacks)
    checkpoint = next(c for c in callbacks if isinstance(c, ModelCheckpoint))
    assert checkpoint.save_top_k == 2 and checkpoint.monitor == "val_acc"
    assert checkpoint.dirpath == str(tmp_path / "mine")  # a dirpath given is kept
    assert type(callbacks[-1]).__name__ == "EarlyStopping"
    assert build_callbacks(compose_cfg(["callbacks=none"]), tmp_path) == []
    # checkpoint=false skips the ModelCheckpoint; a null entry (how a recipe drops one) is skipped too
    unchecked = build_callbacks(compose_cfg(["checkpoint=false", "callbacks.peer_failure_report=null"]), tmp_path)
    assert _types(unchecked) == [EpochThroughputMonitor, LearningRateMonitor]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+callbacks.mine={every: 2}", r"callbacks.mine is \{'every': 2\}: expected a mapping with a _target_"),
        ("callbacks.throughput_monitor._target_=torch.nn.ReLU",
         r"callbacks.throughput_monitor built a ReLU \(torch.nn.ReLU\): expected a lightning.pytorch.Callback"),
    ],
)
def test_a_callback_that_is_not_one_is_refused(override: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        build_callbacks(compose_cfg([override]), tmp_path)
