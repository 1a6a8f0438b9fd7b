"""What every strategy of this package shares, so each strategy file lists only the hooks it changes."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies._errors import ddp_options_set
from lightning_strategies.checkpoint import ATOMIC_CHECKPOINT_IO_DEFAULT
from lightning_strategies.comm.mesh import device_mesh
from lightning_strategies.faults import PeerFailureMixin
from lightning_strategies.strategies._lightning_internals import logged_step, should_update_logs

__all__ = [
    "MetricsWindow",
    "StrategyBase",
    "divisors",
    "exposed",
    "is_last_batch",
    "join_restarted_process_group",
    "log_due",
    "log_values",
    "optimizer_state_unsplit",
    "unwrap_optimizer",
]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, for errors that suggest a size that fits the world."""
    return [d for d in range(1, n + 1) if n % d == 0]


class MetricsWindow:
    """Values collected every step and logged together when Lightning writes step metrics (or at an
    epoch's last batch): means for :meth:`add`, maxima for :meth:`peak`, the last value for :meth:`latest`.

    ``self.log`` costs about 0.3 ms a call, and on CUDA reading a value blocks the host on the device.
    A value is a number or a one-element tensor; tensors stay on their device (float64; float32 on MPS,
    which has none), so collecting never waits. :meth:`flush` reads them in one transfer per device.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float | Tensor] = {}
        self._counts: dict[str, int] = {}
        self._peaks: dict[str, float | Tensor] = {}
        self._latest: dict[str, float | Tensor] = {}

    def add(self, **values: float | Tensor) -> None:
        """One sample of each value; :meth:`flush` reports their mean (per sample)."""
        for key, value in values.items():
            sample = _sample(key, value)
            total = self._sums.get(key)
            self._sums[key] = sample if total is None else total + sample
            self._counts[key] = self._counts.get(key, 0) + 1

    def peak(self, **values: float | Tensor) -> None:
        """Keep the largest value of each key over the window."""
        for key, value in values.items():
            sample = _sample(key, value)
            top = self._peaks.get(key)
            self._peaks[key] = sample if top is None else _maximum(top, sample)

    def latest(self, **values: float | Tensor) -> None:
        """Keep the last value of each key."""
        self._latest.update({key: _sample(key, value) for key, value in values.items()})

    def __bool__(self) -> bool:
        return bool(self._counts or self._peaks or self._latest)

    def flush(self) -> dict[str, float]:
        """The window's values (means, maxima, latest) as floats, then an empty window."""
        sums, peaks, latest = _read_all(self._sums, self._peaks, self._latest)
        out = {key: total / self._counts[key] for key, total in sums.items()}
        out.update(peaks)
        out.update(latest)
        self.clear()
        return out

    def clear(self) -> None:
        """Forget everything collected (a new fit, or a teardown)."""
        self._sums, self._counts, self._peaks, self._latest = {}, {}, {}, {}

    def flush_if_due(self, module: pl.LightningModule | None) -> bool:
        """Log the window when :func:`log_due` says so; call it where ``self.log`` is allowed
        (``optimizer_step``, ``training_step``). Returns whether it was logged (and emptied)."""
        if module is None or module._current_fx_name is None or not self:
            return False
        due = log_due(module._trainer)
        if due is None:
            return False
        log_values(module, self.flush(), at_epoch_end=due == "epoch_end")
        return True


def _sample(key: str, value: float | Tensor) -> float | Tensor:
    if not isinstance(value, Tensor):
        return float(value)
    if value.numel() != 1:  # metadata only: no wait for the device
        raise ValueError(
            f"MetricsWindow found {key} with shape {tuple(value.shape)}: expected one value (a number or a "
            f"one-element tensor). Fix: reduce it first, e.g. {key}=tensor.sum()."
        )
    dtype = torch.float32 if value.device.type == "mps" else torch.float64
    return value.detach().reshape(()).to(dtype)


def _maximum(a: float | Tensor, b: float | Tensor) -> float | Tensor:
    if isinstance(a, Tensor):
        return torch.maximum(a, b) if isinstance(b, Tensor) else a.clamp_min(b)
    return b.clamp_min(a) if isinstance(b, Tensor) else max(a, b)


def _read_all(*windows: dict[str, float | Tensor]) -> list[dict[str, float]]:
    """Each of ``windows`` as floats; all their tensors read with one device-to-host transfer per device."""
    out: list[dict[str, float | Tensor]] = [dict(w) for w in windows]
    by_device: dict[torch.device, list[tuple[int, str]]] = {}
    for i, window in enumerate(windows):
        for key, value in window.items():
            if isinstance(value, Tensor):
                by_device.setdefault(value.device, []).append((i, key))
    for slots in by_device.values():
        read = torch.stack([cast(Tensor, windows[i][key]) for i, key in slots]).tolist()
        for (i, key), value in zip(slots, read, strict=True):
            out[i][key] = value
    return [{key: float(value) for key, value in window.items()} for window in out]


def log_due(trainer: pl.Trainer | None) -> str | None:
    """``"step"`` when Lightning writes step metrics now, ``"epoch_end"`` at another step that ends its
    epoch (else an epoch shorter than ``log_every_n_steps``, or an epoch's tail, would log nothing),
    else ``None``. Ranks that see the same batches agree, so a collective made then pairs up."""
    if trainer is None:
        return None
    if should_update_logs(trainer):
        return "step"
    return "epoch_end" if is_last_batch(trainer) else None


def log_values(module: pl.LightningModule, values: dict[str, float], *, at_epoch_end: bool) -> None:
    """``module.log_dict`` the values; at an epoch's end, where Lightning writes no step metrics, also to loggers."""
    module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
    trainer = module._trainer
    if not at_epoch_end or trainer is None:
        return
    step = logged_step(trainer)
    for logger in trainer.loggers:  # rank zero only, as Lightning's own logging
        logger.log_metrics(values, step=step)


def is_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch being run is the last of its epoch (False when unknown)."""
    try:
        loop = trainer.fit_loop.epoch_loop
        if loop.batch_progress.is_last_batch:
            return True
        batches = trainer.num_training_batches
        return isinstance(batches, int) and loop.batch_idx + 1 >= batches
    except (AttributeError, RuntimeError, TypeError):
        return False


def join_restarted_process_group(backend: str, timeout: timedelta | None) -> bool:
    """After a torchrun restart, initialise the default group through a per-attempt store (Lightning then
    leaves it alone); returns whether it did. torch 2.14's workers share the agent's store across
    restarts, keyed by group name only, so a restarted rank could read the dead attempt's gloo
    addresses ("Gloo connectFullMesh failed"; pytorch/pytorch#167288 looks like the same with NCCL)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    timeout = timeout or timedelta(minutes=30)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"/worker/attempt_{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return True


def exposed(attribute: str, doc: str) -> Any:
    """A read-only property returning ``self.<attribute>``, documented by ``doc``; annotate the class
    attribute with the value's type (``wire_dtype: str | None = exposed("_wire_dtype", "...")``)."""
    return property(operator.attrgetter(attribute), doc=doc)


#: The options every strategy here takes besides its own (the Trainer sets the plugins).
_LAUNCH_OPTIONS = frozenset(
    {
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
        "process_group_backend",
        "timeout",
        "start_method",
    }
)


class StrategyBase(PeerFailureMixin, DDPStrategy):
    """The base of every strategy here: a ``DDPStrategy`` (same launchers, same groups) with lost peers
    named on failure (:class:`~lightning_strategies.faults.PeerFailureMixin`), the process group joined
    again after a torchrun restart, :class:`~lightning_strategies.AtomicCheckpointIO` unless the user
    gives one, :attr:`failed` (teardown must then not wait for peers: a graceful shutdown or a group's
    destruction would wait for a dead one), one :attr:`metrics` window, and the optimizer state of a
    runtime (servers, stages) kept at fit end for a ``Trainer.save_checkpoint`` after fit.
    """

    checkpoint_io = ATOMIC_CHECKPOINT_IO_DEFAULT  # atomic checkpoint writes unless the user gives an IO
    #: Whether the model is wrapped in DDP: only then do DDP's own options (``find_unused_parameters``, ...) apply.
    wraps_ddp: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not self.wraps_ddp and (ddp_only := ddp_options_set(kwargs, _LAUNCH_OPTIONS)):
            raise TypeError(
                f"{type(self).__name__} got {ddp_only}: expected its own options and {sorted(_LAUNCH_OPTIONS)}, "
                f"because it does not wrap the model in DistributedDataParallel. Fix: drop {ddp_only}."
            )
        super().__init__(*args, **kwargs)
        self._failed = False
        self.metrics = MetricsWindow()
        self._state_at_fit_end: dict[int, dict[str, Any]] = {}  # id(optimizer) -> gathered state

    failed: bool = exposed("_failed", "Whether ``on_exception`` was called and teardown has not ended yet.")

    @property
    def trainer(self) -> pl.Trainer | None:
        """The trainer running this strategy (``None`` before a module is attached to one)."""
        module = self.lightning_module
        return module._trainer if module is not None else None

    @property
    def _module(self) -> pl.LightningModule:
        """The attached LightningModule, in hooks that only run with one."""
        module = self.lightning_module
        assert module is not None
        return module

    @override
    def setup_distributed(self) -> None:
        join_restarted_process_group(self._get_process_group_backend(), self._timeout)
        super().setup_distributed()

    def _init_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A mesh whose groups get this strategy's backend and timeout (new groups default to 30 minutes)."""
        backend = self._get_process_group_backend()
        return device_mesh(self.root_device.type, shape, names, backend=backend, timeout=self._timeout)

    def _fitting(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._state_at_fit_end = {}  # a new fit: the last one's state is stale
        super().setup(trainer)

    def _keep_state_at_fit_end(self) -> None:
        """Gather every optimizer's state now (a collective: every rank calls this) and keep it."""
        self._state_at_fit_end = {id(unwrap_optimizer(o)): self.optimizer_state(o) for o in self.optimizers}

    def _state_after_fit(self, optimizer: Optimizer) -> dict[str, Any] | None:
        return self._state_at_fit_end.get(id(unwrap_optimizer(optimizer)))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_optimizer_step()
        return output

    def _after_optimizer_step(self) -> None:
        """Collect this step's metrics into :attr:`metrics` and flush when due (``self.log`` is allowed here)."""

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # peers may be gone: teardown must not wait for them
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.metrics.clear()
        super().teardown()
        self._failed = False


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state_unsplit(strategy: StrategyBase, optimizer: Optimizer) -> dict[str, Any]:
    """A model-parallel strategy's optimizer state after fit: the one gathered at fit end, else the optimizer's."""
    kept = strategy._state_after_fit(optimizer)
    return kept if kept is not None else optimizer.state_dict()
