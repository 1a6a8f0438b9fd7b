"""``run(cfg)``: build data, model, strategy and trainer from a Hydra config; fit; test; summarise.

In a Hydra multirun a job runs in the sweep's process (Hydra's basic launcher) or in one of
its own (submitit, ...). Lightning's subprocess launcher starts ranks 1..N-1 by re-running the
command line of the process it runs in, which in a sweep is not this job's command (the whole
sweep, or the launcher's own program), so a job that needs such ranks runs as a fresh single run
of the app (``python -m recipes.app`` with the job's overrides), inside which Lightning's
launcher starts them. Jobs of one process, and jobs whose ranks SLURM or torchrun started, run
where they are. Either way a failing job writes a failed ``metrics.json`` (a failed row of the
sweep's ``summary.md``) instead of stopping the sweep.
"""

from __future__ import annotations

import inspect
import json
import logging
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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

import lightning_strategies  # noqa: F401  (registers the strategy names)
from lightning_strategies.scaling import ScalingPlan, replicas_of
from recipes.checks import check_missing_values, check_strategy_options
from recipes.classification import ClassificationModule, EpochThroughputMonitor

__all__ = ["ConfigError", "build_callbacks", "build_module", "run"]

log = logging.getLogger(__name__)

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
        if choice == "advised":  # name what the advisor chose (every rank built the same, recipes.advise)
            from recipes.advise import ENV

            chosen = json.loads(os.environ.get(ENV) or "{}").get("name")
            return f"advised:{chosen}" if chosen else "advised"
        if choice:
            return str(choice)
    return type(strategy).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Write then rename, so a crash never leaves a truncated metrics.json behind.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def _check_devices(accelerator: str, devices: Any) -> None:
    """Refuse device counts that cannot run; warn about CPU processes sharing cores (Lightning runs them)."""
    if accelerator in ("gpu", "cuda") and torch.cuda.device_count() == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator}: found no CUDA device on this machine: expected at least one GPU "
            "for trainer=gpu. Fix: run on the CPU with trainer=cpu (one process) or trainer=ddp_sim (2 processes; "
            "trainer.devices=N for N), e.g. `python train.py trainer=ddp_sim strategy=ring`; or keep the GPU "
            "settings with trainer.accelerator=cpu trainer.precision=32-true"
        )
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
        if count > available:
            raise ConfigError(
                f"trainer.devices={count}: found {available} CUDA GPUs on this machine: expected at most "
                f"{available}. Fix: set trainer.devices={available} (or -1 for all), or use more nodes with "
                "trainer.num_nodes"
            )
    elif accelerator == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if count > cores:
            # Lightning starts them (processes are not cores); each step is slower, nothing breaks
            rank_zero_warn(
                f"trainer.devices={count} CPU processes on {cores} cores: they share the cores, so each step is "
                f"slower than with {cores} processes (fine for testing a multi-process set-up)"
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


def _batch_size(datamodule: pl.LightningDataModule) -> int | None:
    """The DataModule's per-device ``batch_size``, if it has one (the scaling rule and
    ``global_batch_size`` need it)."""
    batch = getattr(datamodule, "batch_size", None)
    return batch if isinstance(batch, int) and not isinstance(batch, bool) else None


def _check_train_batches(datamodule: pl.LightningDataModule, replicas: int) -> None:
    """Stop before training when the train split cannot fill one batch per replica: Lightning
    would only warn and fit nothing, and the run would report an untrained model.

    Checked for DataModules with an int ``batch_size`` and a ``train_set`` (this package's); others
    are left to Lightning.
    """
    batch = _batch_size(datamodule)
    if batch is None or not hasattr(datamodule, "train_set"):
        return
    datamodule.setup("fit")
    train = datamodule.train_set
    if train is None:
        return
    samples = len(train)
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


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _ranks_started_externally() -> bool:
    """Whether a cluster started every rank of this job (SLURM's srun, torchrun, LSF): then each
    rank runs the job itself and Lightning launches nothing."""
    from lightning.fabric.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment

    return SLURMEnvironment.detect() or TorchElasticEnvironment.detect() or LSFEnvironment.detect()


def _local_processes(cfg: DictConfig) -> int:
    """How many processes Lightning would start on this node for ``cfg`` (1 when it cannot tell more)."""
    strategy = cfg.get("strategy")
    if isinstance(strategy, DictConfig) and str(strategy.get("_target_", "")).endswith("SingleDeviceStrategy"):
        return 1
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, list | tuple) or OmegaConf.is_list(devices):
        return len(devices)
    if devices in (-1, "-1", "auto"):
        gpu = cfg.trainer.get("accelerator") in ("gpu", "cuda", "auto")
        return torch.cuda.device_count() if gpu and torch.cuda.is_available() else 1
    try:
        return int(devices)
    except (TypeError, ValueError):
        return 1


def _job_needs_own_process(cfg: DictConfig) -> bool:
    """Whether this sweep job must run as a fresh single run of the app (see the module docstring):
    Lightning would start more processes by re-running this process's command line."""
    if _ranks_started_externally():
        return False
    strategy = cfg.get("strategy")
    start_method = strategy.get("start_method", "popen") if isinstance(strategy, DictConfig) else "popen"
    return start_method == "popen" and _local_processes(cfg) > 1  # fork/spawn launchers re-run nothing


def _app_command(out_dir: Path, job_overrides: list[str]) -> list[str]:
    """``python -m recipes.app`` with this job's config sources and overrides, as a single run in ``out_dir``."""
    hydra_cfg = HydraConfig.get()
    command = [sys.executable, "-m", "recipes.app"]
    for source in hydra_cfg.runtime.config_sources:
        if source.schema != "file":
            continue
        if source.provider == "main":
            command += ["--config-path", source.path]
        elif source.provider == "command-line":
            command += ["--config-dir", source.path]  # `--config-dir` given to the sweep
    command += ["--config-name", str(hydra_cfg.job.config_name), *job_overrides]
    # hydra.mode=RUN: an hparams_search config may set MULTIRUN, and this is one job of it
    return [*command, f'hydra.run.dir="{out_dir}"', "hydra.mode=RUN"]


def _run_job_in_subprocess(cfg: DictConfig) -> dict[str, Any]:
    """Run this multirun job as a fresh single run of the app, and collect its metrics."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    job_overrides = list(hydra_cfg.overrides.task)
    command = _app_command(out_dir, job_overrides)
    # `python -m recipes.app` imports recipes from the path it was imported from here
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    rank_zero_info(f"job {hydra_cfg.job.num}: {' '.join(job_overrides) or '(defaults)'} -> {out_dir}")
    stderr_tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, bufsize=1, env=env, cwd=hydra_cfg.runtime.cwd
    ) as proc:
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
    reported = [line.removeprefix("Error: ") for line in errors if line.startswith("Error: ")]  # recipes.failures
    reason = (reported or errors or [""])[-1]
    failed = {
        "status": "failed",
        "exit_code": code,
        "error": reason.strip() or f"exited with code {code}",
        "stderr_tail": list(stderr_tail),
        "overrides": job_overrides,
    }
    _write_json(metrics_path, failed)
    return failed


def _run_job_here(cfg: DictConfig) -> dict[str, Any]:
    """Run this multirun job in this process; an error becomes a failed ``metrics.json``, not a stopped sweep."""
    try:
        return _fit(cfg)
    except Exception as err:
        log.exception("job %s failed", HydraConfig.get().job.num)
        failed = {
            "status": "failed",
            "error": f"{type(err).__name__}: {err}",
            "overrides": list(HydraConfig.get().overrides.task),
        }
        if getattr(rank_zero_only, "rank", 0) == 0:  # under SLURM every rank runs the job; one writes
            out_dir = _output_dir(cfg)
            out_dir.mkdir(parents=True, exist_ok=True)
            _write_json(out_dir / METRICS_FILE, failed)
        return failed


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate one configuration; return (and, on rank 0, write) its metrics.

    In a multirun a job that fails returns (and writes) ``{"status": "failed", "error": ...}``.

    Raises:
        ConfigError: (a single run) for settings that cannot train, before any training starts.
    """
    if not _in_sweep():
        return _fit(cfg)
    if _job_needs_own_process(cfg):
        return _run_job_in_subprocess(cfg)
    return _run_job_here(cfg)


_OFFERED = ("num_classes", "in_channels", "optimizer", "scaling", "plan")


def _accepted(factory: Any) -> tuple[set[str], set[str]]:
    """Which of :data:`_OFFERED` ``factory`` names as parameters and does not already fix, and
    which of those it requires (no default)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return set(), set()
    fixed = set(getattr(factory, "keywords", None) or ())
    accepted = {name for name in _OFFERED if name in params and name not in fixed}
    return accepted, {name for name in accepted if params[name].default is inspect.Parameter.empty}


def build_module(
    node: DictConfig,
    datamodule: pl.LightningDataModule,
    *,
    optimizer: Any,
    scaling: Any,
    plan: ScalingPlan | None,
    no_decay_norm_bias: bool = True,
    label_smoothing: float = 0.0,
) -> pl.LightningModule:
    """The LightningModule ``node`` (the ``model`` group) describes.

    - ``_target_`` builds a LightningModule: it is used as it is.
    - ``_partial_: true``: it is called with those of ``num_classes`` and ``in_channels`` (the
      DataModule's), ``optimizer`` (the optimizer group's partial), ``scaling`` (ScalingConfig)
      and ``plan`` (ScalingPlan: global batch and scaled lr) that its signature names; what it
      returns is used if it is a LightningModule, and trained by :class:`ClassificationModule`
      (cross-entropy, accuracy, the optimizer and scaling groups) if it is a bare ``nn.Module``.

    Raises:
        ConfigError: it builds something else, or a bare network needs ``num_classes`` the data lacks.
    """
    built = _build(node)
    if isinstance(built, pl.LightningModule):
        return built
    target = node.get("_target_")
    if not callable(built) or isinstance(built, torch.nn.Module):
        raise ConfigError(
            f"model._target_={target} built a {type(built).__name__}: expected a LightningModule, or (with "
            "_partial_: true) a callable returning a LightningModule or an nn.Module. Fix: point model._target_ "
            "at a LightningModule class, or add `_partial_: true` to a network factory"
        )
    offered = {
        "num_classes": getattr(datamodule, "num_classes", None),
        "in_channels": getattr(datamodule, "in_channels", None),
        "optimizer": optimizer,
        "scaling": scaling,
        "plan": plan,
    }
    accepted, required = _accepted(built)
    lacking = sorted(name for name in required if offered[name] is None)
    if lacking:
        raise ConfigError(
            f"model._target_={target} needs {' and '.join(lacking)} from the data: found "
            f"{type(datamodule).__name__} without {' or '.join(lacking)}. Fix: give the DataModule "
            f"{' and '.join(lacking)} attributes, or set them in the model config (model.{lacking[0]}=...)"
        )
    obj = built(**{k: v for k, v in offered.items() if k in accepted and v is not None})
    if isinstance(obj, pl.LightningModule):
        if not {"optimizer", "plan"} & accepted:
            rank_zero_info(
                f"model: {type(obj).__name__} takes neither `optimizer` nor `plan`: its own configure_optimizers "
                "sets the lr; the optimizer and scaling groups are not applied"
            )
        return obj
    if not isinstance(obj, torch.nn.Module):
        raise ConfigError(
            f"model._target_={target} returned a {type(obj).__name__}: expected a LightningModule or an "
            "nn.Module. Fix: point model._target_ at a LightningModule class or a network factory"
        )
    num_classes = offered["num_classes"]
    if not isinstance(num_classes, int):
        raise ConfigError(
            f"model._target_={target} builds a bare network, which the classification wrapper trains with "
            f"num_classes from the data: found {type(datamodule).__name__} without an int num_classes. Fix: give "
            "the DataModule num_classes (and in_channels), or point model._target_ at a LightningModule"
        )
    return ClassificationModule(
        obj,
        num_classes=num_classes,
        optimizer=optimizer,
        scaling=scaling,
        plan=plan,
        no_decay_norm_bias=no_decay_norm_bias,
        label_smoothing=label_smoothing,
    )


class ConfigAsHyperparameters(pl.Callback):
    """Logs the run's config as hyperparameters to every logger when fit starts.

    In the training processes, where Lightning logs a module's own hyperparameters, not before fit
    in the launching process: a logger touched there before fork-started ranks would keep a stale
    copy of its state (the CSV logger then rewrites metrics.csv with the wrong header at ``test``).
    """

    def __init__(self, hparams: dict[str, Any] | None = None) -> None:
        self.hparams: dict[str, Any] = hparams or {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers:  # rank-zero-only, as Lightning's loggers are
            logger.log_hyperparams(self.hparams)


def _hyperparameters(cfg: DictConfig, plan: ScalingPlan | None) -> dict[str, Any]:
    """The composed config (resolved) and the derived batch and lr: what every logger records."""
    params = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(params, dict)
    hparams: dict[str, Any] = {str(k): v for k, v in params.items()}
    if plan is not None:
        hparams["plan"] = plan.as_dict()
    if HydraConfig.initialized():
        hparams["overrides"] = list(HydraConfig.get().overrides.task)
    return hparams


def _fit(cfg: DictConfig) -> dict[str, Any]:
    """One run: build everything from ``cfg``, fit, test, write ``metrics.json`` on rank 0."""
    start = time.perf_counter()
    torch.set_float32_matmul_precision("high")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = _output_dir(cfg)
    try:  # before anything is built: an unknown strategy option would otherwise fail in the started ranks
        check_missing_values(cfg)
        check_strategy_options(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_lr_and_epochs(cfg)
    resume = _resume_path(cfg)

    datamodule = _build(cfg.data)
    if not isinstance(datamodule, pl.LightningDataModule):
        raise ConfigError(
            f"data._target_={cfg.data.get('_target_')} built a {type(datamodule).__name__}: expected a "
            "LightningDataModule. Fix: point data._target_ at a LightningDataModule class"
        )
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
    throughput = next((c for c in callbacks if isinstance(c, EpochThroughputMonitor)), None)
    if throughput is None:
        rank_zero_info(
            "no EpochThroughputMonitor among the callbacks: samples_per_s, val_acc_by_epoch and "
            "seconds_to_val_acc_95 will be null in metrics.json (n/a in the summary)"
        )
    logger = _build(cfg.logger)(save_dir=str(out_dir))
    config_logger = ConfigAsHyperparameters()
    callbacks.append(config_logger)
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
        if _batch_size(datamodule) is None:
            raise ConfigError(
                f"global_batch_size={cfg.global_batch_size}: found {type(datamodule).__name__} without an int "
                "batch_size attribute: expected a per-device batch_size the app can set. Fix: give the DataModule "
                "a batch_size attribute its loaders use, or global_batch_size=null"
            )
        datamodule.batch_size = per_device  # type: ignore[attr-defined]
    _check_train_batches(datamodule, replicas_of(trainer.strategy))
    # Derived here, once, so bad scaling arithmetic stops the run before any worker process starts.
    plan: ScalingPlan | None = None
    if _batch_size(datamodule) is not None:
        plan = scaling.plan(
            base_lr=float(cfg.optimizer.lr),
            per_device=_batch_size(datamodule),
            replicas=replicas_of(trainer.strategy),
            accumulate=trainer.accumulate_grad_batches,
        )
        rank_zero_info(plan.describe())
    config_logger.hparams = _hyperparameters(cfg, plan)
    module = build_module(
        cfg.model,
        datamodule,
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
        **(plan.as_dict() if plan is not None else {}),
    }
    # everything else the module, the strategy (comm/*, ps/*, async/*, pipeline/*) and callbacks logged
    metrics.update({k: v for k, v in {**fit_metrics, **test_metrics}.items() if k not in metrics})
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
