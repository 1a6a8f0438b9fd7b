"""``run(cfg)``: build data, model, strategy and trainer from a Hydra config; fit; test; summarise.

Under a Hydra multirun each job runs in its own process (a single run of this script with the
job's overrides), so Lightning's subprocess launcher, which re-runs the command line for every
rank, re-runs *that job* and not the whole sweep; a failing job becomes a failed row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

import lightning_strategies  # noqa: F401  (registers the strategy names)
from lightning_strategies.scaling import replicas_of
from recipes.classification import ClassificationModule, ThroughputMonitor

__all__ = ["ConfigError", "build_callbacks", "run"]

METRICS_FILE = "metrics.json"


class ConfigError(ValueError):
    """A configuration that cannot train, found before training starts."""


def _torch_device(accelerator: str) -> str:
    if accelerator in ("gpu", "cuda"):
        return "cuda:0"
    if accelerator == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return str(accelerator)


if not OmegaConf.has_resolver("torch_device"):
    OmegaConf.register_new_resolver("torch_device", _torch_device)


def _build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, but raising the object's own error (not Hydra's wrapper),
    so a bad value reads as "data.batch_size ... found 0" rather than a stack of frames."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, Exception):
            raise err.__cause__ from None
        raise


def _output_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or os.getcwd())


def _strategy_name(cfg: DictConfig, strategy: Any) -> str:
    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("strategy")
        if choice:
            return str(choice)
    return type(strategy).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Write then rename, so a crash never leaves a truncated metrics.json behind.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def _check_devices(accelerator: str, devices: Any) -> None:
    if devices in (-1, "-1", "auto"):
        return
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return  # a list of device indices: Lightning checks it
    if count < 1:
        raise ConfigError(f"trainer.devices must be >= 1, found {devices}; set trainer.devices=1 or more")
    if accelerator in ("gpu", "cuda"):
        available = torch.cuda.device_count()
        where = "CUDA GPUs"
    elif accelerator == "cpu":
        available = os.cpu_count() or 1
        where = "CPU cores"
    else:
        return
    if count > available:
        raise ConfigError(
            f"trainer.devices={count} but this machine has {available} {where}; "
            f"set trainer.devices to at most {available} (or use more nodes with trainer.num_nodes)"
        )


def _check_lr_and_epochs(cfg: DictConfig) -> None:
    lr = cfg.optimizer.get("lr")
    if lr is None or not isinstance(lr, int | float) or lr <= 0:
        raise ConfigError(f"optimizer.lr must be a positive number, found {lr!r}; e.g. optimizer.lr=0.1")
    epochs = cfg.trainer.get("max_epochs")
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1) and epochs != -1:
        raise ConfigError(f"trainer.max_epochs must be a positive integer, found {epochs!r}")


def _resume_path(cfg: DictConfig) -> str | None:
    """The checkpoint ``resume`` names (``ckpt_path`` of ``fit``), checked to exist before anything is built."""
    resume = cfg.get("resume")
    if resume is None:
        return None
    path = Path(os.path.expanduser(str(resume)))
    if path.is_file():
        return str(path)
    hint = ""
    if path.is_dir():
        found = [c for c in (path / "checkpoints" / "last.ckpt", path / "last.ckpt") if c.is_file()]
        hint = f" (it is a directory{f'; did you mean {found[0]}' if found else ''})"
    raise ConfigError(
        f"resume={resume!r}: no checkpoint file at {path}{hint}; expected a .ckpt written by an earlier run, e.g. "
        "<run dir>/checkpoints/last.ckpt. Fix: set resume=<path to the .ckpt>, or resume=null to start fresh"
    )


def _per_device_batch(cfg: DictConfig, trainer: pl.Trainer) -> int | None:
    global_batch = cfg.get("global_batch_size")
    if global_batch is None:
        return None
    replicas, accumulate = replicas_of(trainer.strategy), trainer.accumulate_grad_batches
    shares = replicas * accumulate  # the global batch is split into this many equal per-device batches
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch_size must be a positive integer, found {global_batch!r}")
    if global_batch < shares:
        raise ConfigError(
            f"global batch {global_batch} is smaller than {replicas} replicas x {accumulate} accumulation steps: "
            f"each device would get a batch of 0 samples; set global_batch_size to a multiple of {shares} "
            "(or run fewer processes)"
        )
    if global_batch % shares:
        raise ConfigError(
            f"global batch {global_batch} is not divisible by {replicas} replicas x {accumulate} accumulation steps; "
            f"choose a global_batch_size that is a multiple of {shares}"
        )
    return global_batch // shares


def _check_train_batches(datamodule: pl.LightningDataModule, replicas: int) -> None:
    """Stop before training when the train split cannot fill one batch per replica: Lightning
    would only warn and fit nothing, and the run would report an untrained model."""
    datamodule.setup("fit")
    train = getattr(datamodule, "train_set", None)
    if train is None:
        return
    samples, batch = len(train), int(datamodule.batch_size)  # type: ignore[attr-defined]
    per_replica = -(-samples // replicas)  # the distributed sampler pads the shares to equal length
    if per_replica // batch == 0:  # the train loader drops a last, partial batch
        raise ConfigError(
            f"the train split has {samples} samples ({per_replica} per replica over {replicas} replicas), fewer than "
            f"one per-device batch of {batch}: no training step would run; expected at least {batch * replicas} "
            "samples. Fix: use more data, or a smaller data.batch_size (or global_batch_size)"
        )


def build_callbacks(cfg: DictConfig, out_dir: Path) -> list[pl.Callback]:
    """The Trainer's callbacks, one per entry of ``cfg.callbacks`` (``conf/callbacks/``), in order.

    An entry set to null is dropped; with ``checkpoint=false`` so is every ``ModelCheckpoint``, and
    one whose ``dirpath`` is null writes into ``<run dir>/checkpoints``.

    Raises:
        ConfigError: for an entry without a ``_target_``, or one that builds something else than a callback.
    """
    callbacks: list[pl.Callback] = []
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            found = OmegaConf.to_container(node) if isinstance(node, DictConfig) else node
            raise ConfigError(
                f"callbacks.{name} is {found!r}: expected a mapping with a _target_ (a Callback class) and its "
                f"arguments. Fix: set callbacks.{name}._target_=<module.Class>, or drop it with ~callbacks.{name}"
            )
        kwargs: dict[str, Any] = {}
        target = get_object(node._target_)
        if isinstance(target, type) and issubclass(target, ModelCheckpoint):
            if not cfg.checkpoint:
                continue
            if node.get("dirpath") is None:
                kwargs["dirpath"] = str(out_dir / "checkpoints")
        callback = _build(node, **kwargs)
        if not isinstance(callback, pl.Callback):
            raise ConfigError(
                f"callbacks.{name} built a {type(callback).__name__} ({node._target_}): expected a "
                f"lightning.pytorch.Callback. Fix: point callbacks.{name}._target_ at a Callback class"
            )
        callbacks.append(callback)
    return callbacks


def _is_multirun_parent() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_job_in_subprocess(cfg: DictConfig) -> dict[str, Any]:
    """Run this multirun job as a fresh single run of the same script, and collect its metrics."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    job_overrides = list(hydra_cfg.overrides.task)
    command = [sys.executable, os.path.abspath(sys.argv[0])]
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            command += ["--config-path", source.path]
    command += ["--config-name", str(hydra_cfg.job.config_name), *job_overrides, f'hydra.run.dir="{out_dir}"']
    rank_zero_info(f"job {hydra_cfg.job.num}: {' '.join(job_overrides) or '(defaults)'} -> {out_dir}")
    stderr_tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # forward as it comes, keep the end for the report
            sys.stderr.write(line)
            stderr_tail.append(line.rstrip("\n"))
        code = proc.wait()
    metrics_path = out_dir / METRICS_FILE
    if code == 0 and metrics_path.exists():
        return dict(json.loads(metrics_path.read_text()))
    hydra_hints = ("Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc")
    errors = [line for line in stderr_tail if line.strip() and not line.startswith(hydra_hints)]
    reason = errors[-1] if errors else ""
    failed = {
        "status": "failed",
        "exit_code": code,
        "error": reason.strip() or f"exited with code {code}",
        "stderr_tail": list(stderr_tail),
        "overrides": job_overrides,
    }
    _write_json(metrics_path, failed)
    return failed


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate one configuration; return (and, on rank 0, write) its metrics.

    Raises:
        ConfigError: for settings that cannot train, before any training starts.
    """
    if _is_multirun_parent():
        return _run_job_in_subprocess(cfg)
    start = time.perf_counter()
    torch.set_float32_matmul_precision("high")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = _output_dir(cfg)
    _check_lr_and_epochs(cfg)
    resume = _resume_path(cfg)

    datamodule = _build(cfg.data)
    model = _build(cfg.model)(num_classes=datamodule.num_classes, in_channels=datamodule.in_channels)
    optimizer, scaling = _build(cfg.optimizer), _build(cfg.scaling)

    strategy = _build(cfg.strategy)
    trainer_factory = _build(cfg.trainer)
    trainer_overrides: dict[str, Any] = {}
    if isinstance(strategy, SingleDeviceStrategy) and trainer_factory.keywords.get("devices", 1) != 1:
        rank_zero_info("strategy=single runs one process: using trainer.devices=1")
        trainer_overrides.update(devices=1, num_nodes=1)
    accelerator = str(trainer_factory.keywords.get("accelerator", "cpu"))
    _check_devices(accelerator, trainer_overrides.get("devices", trainer_factory.keywords.get("devices", 1)))

    callbacks = build_callbacks(cfg, out_dir)
    throughput = next((c for c in callbacks if isinstance(c, ThroughputMonitor)), None)
    if throughput is None:
        rank_zero_info(
            "no ThroughputMonitor among the callbacks: samples_per_s, val_acc_by_epoch and "
            "seconds_to_val_acc_95 will be null in metrics.json (n/a in the summary)"
        )
    logger = _build(cfg.logger)(save_dir=str(out_dir))
    trainer: pl.Trainer = trainer_factory(
        strategy=strategy,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=str(out_dir),
        # Lightning adds a ModelCheckpoint of its own when this is true and none is given
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **trainer_overrides,
    )
    per_device = _per_device_batch(cfg, trainer)
    if per_device is not None:
        datamodule.batch_size = per_device
    _check_train_batches(datamodule, replicas_of(trainer.strategy))
    # Derived here, once, so bad scaling arithmetic stops the run before any worker process starts.
    plan = scaling.plan(
        base_lr=float(cfg.optimizer.lr),
        per_device=datamodule.batch_size,
        replicas=replicas_of(trainer.strategy),
        accumulate=trainer.accumulate_grad_batches,
    )
    rank_zero_info(plan.describe())
    module = ClassificationModule(
        model,
        num_classes=datamodule.num_classes,
        optimizer=optimizer,
        scaling=scaling,
        plan=plan,
        no_decay_norm_bias=cfg.no_decay_norm_bias,
        label_smoothing=cfg.label_smoothing,
    )

    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    test_metrics: dict[str, float] = {}
    if cfg.run_test:
        results = trainer.test(module, datamodule=datamodule, verbose=False)
        test_metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}

    metrics: dict[str, Any] = {
        "status": "ok",
        "strategy": _strategy_name(cfg, strategy),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "test_acc": test_metrics.get("test_acc"),
        "test_loss": test_metrics.get("test_loss"),
        "val_acc": fit_metrics.get("val_acc"),
        "val_loss": fit_metrics.get("val_loss"),
        "train_loss": fit_metrics.get("train_loss_epoch"),
        "samples_per_s": throughput.samples_per_s() if throughput else None,
        "samples_per_s_by_epoch": throughput.epoch_rates if throughput else None,
        "val_acc_by_epoch": [acc for _, acc in throughput.val_curve] if throughput else None,
        "seconds_to_val_acc_95": throughput.time_to_val_acc(0.95) if throughput else None,
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "wall_s": time.perf_counter() - start,
        **plan.as_dict(),
        **{k: v for k, v in fit_metrics.items() if "/" in k},  # comm/*, ps/*, async/*, pipeline/*
    }
    if HydraConfig.initialized():
        metrics["overrides"] = list(HydraConfig.get().overrides.task)
    if trainer.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_json(out_dir / METRICS_FILE, metrics)
        _print_summary(metrics, out_dir)
    return metrics


def _summary_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _print_summary(metrics: dict[str, Any], out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    for key in ("strategy", "world_size", "global_batch_size", "lr", "test_acc", "val_acc", "train_loss",
                "samples_per_s", "wall_s"):
        table.add_row(key, _summary_cell(metrics.get(key)))
    Console(stderr=False).print(table)
    print(f"metrics: {out_dir / METRICS_FILE}", flush=True)
