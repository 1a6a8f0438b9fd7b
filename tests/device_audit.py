"""Audit a CPU run for two things that only hurt on a GPU: collectives given a tensor that would not
be on the strategy's device, and host reads of tensors (each a host-device sync on CUDA) in steps
where nothing is logged.

**Where each tensor would be on CUDA.** On CPU every tensor is on ``cpu``, so a collective given
``torch.tensor([...])`` passes on gloo and fails on NCCL ("No backend type associated with device
type cpu"). :class:`PlacementMode` (a ``TorchFunctionMode``) replays CUDA's placement rules on
tags: a tensor made by a factory (``torch.tensor``, ``zeros``, ``arange``, ``from_numpy``, ...)
without ``device=``, or by ``.cpu()``, is tagged *host*, as it would be on a CUDA run; an op whose
tensor inputs are all host tensors gives a host tensor (``.to(dtype)``, views, ``zeros_like``,
``stack``); an explicit ``device=`` or ``.to(device)`` gives a device tensor. Everything else
(parameters, gradients, batches Lightning moved, buffers made by C++ code) is on the device.
:func:`audit_collectives` wraps every ``torch.distributed`` collective and point-to-point call
(and DTensor's functional collectives) and records each host tensor handed to one, with the
caller's file and line.

It covers code that runs under the mode: the thread that pushed it and threads started with
``threading.Thread`` while the audit is on (the ring's reducer thread). It does not see tensors
made in C++-started threads (TensorPipe's RPC handlers), and it cannot tell ``device=x.device``
from ``device="cpu"`` (both are explicit, both are ``cpu`` here): an explicit wrong device is
not caught, a forgotten one (the usual bug) is.

**Host reads.** :func:`audit_host_reads` counts ``Tensor.item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__``, ``__float__``, ``__int__`` called, directly or through torch's own Python code, from
``lightning_strategies/`` or ``recipes/``, each tagged with the training step it happened in.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_strategies.strategies._base import log_due

ROOT = Path(__file__).resolve().parents[1]
OUR_CODE = (str(ROOT / "lightning_strategies") + "/", str(ROOT / "recipes") + "/")
_TORCH = str(Path(torch.__file__).parent) + "/"

_HOST: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensors that would be on the host on CUDA

#: Factories whose result lands on the default device (the host) unless ``device=`` is given.
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.scalar_tensor, torch.empty_strided, torch.from_numpy, torch.frombuffer,
}  # fmt: skip
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` would be a host tensor on a CUDA run (see the module docstring)."""
    return t in _HOST


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _has_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("device") is not None:
        return True
    # .to(device) / .to("cpu") / .to(other_tensor): an explicit target
    return any(isinstance(a, torch.device | str | torch.Tensor) for a in args[1:])


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", ""))


class PlacementMode(TorchFunctionMode):
    """Tag every tensor that would be on the host on a CUDA run (thread-local, as every mode)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        host: bool | None = None
        inputs = _tensors((args, kwargs))
        if func in _TO_HOST:
            host = True
        elif func in _FACTORIES and not (func in (torch.as_tensor, torch.asarray) and inputs):
            host = kwargs.get("device") is None
        elif func is torch.Tensor.to or _name(func).startswith("new_") or _name(func).endswith("_like"):
            # an explicit target device, else the device of the tensor it is made from
            host = False if _has_device(args, kwargs) else bool(inputs) and is_host(inputs[0])
        elif inputs:
            host = all(is_host(t) for t in inputs)
        if host is None:
            return out
        for t in _tensors(out):
            if host:
                _HOST[t] = True
            else:
                _HOST.pop(t, None)
        return out


def _caller() -> str:
    """``file:line (function)`` of the nearest frame outside torch (and outside this module)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclass
class Audit:
    """What one process saw."""

    off_device: list[str] = field(default_factory=list)  # "<collective> <caller>: <why>"
    collectives: dict[str, int] = field(default_factory=dict)  # calls per collective name
    reads: list[tuple[int | None, str, str]] = field(default_factory=list)  # (step, method, caller)
    due: dict[int, bool] = field(default_factory=dict)  # step -> whether metrics were logged at it
    step: int | None = None  # the training step running now (None outside training batches)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({**self.__dict__, "due": {str(k): v for k, v in self.due.items()}}))

    @staticmethod
    def load(path: Path) -> Audit:
        data = json.loads(path.read_text())
        data["due"] = {int(k): v for k, v in data["due"].items()}
        data["reads"] = [tuple(r) for r in data["reads"]]
        return Audit(**data)

    def reads_from_our_code(self) -> list[tuple[int | None, str, str]]:
        return [r for r in self.reads if r[2].startswith(OUR_CODE)]


_COLLECTIVES = [
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "all_reduce_coalesced",
]  # fmt: skip
_FUNCOL = [
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
    "permute_tensor",
]  # fmt: skip


_inside = threading.local()  # depth of audited calls on this thread, per kind


@contextmanager
def _outermost(kind: str) -> Iterator[bool]:
    """Whether this is the outermost audited call on the thread: PlacementMode hands torch's
    collectives and tensor methods back to the function of their public name (the wrapper), so
    each audited call arrives twice."""
    depth = getattr(_inside, kind, 0)
    setattr(_inside, kind, depth + 1)
    try:
        yield depth == 0
    finally:
        setattr(_inside, kind, depth)


def _checked(name: str, original: Callable[..., Any], audit: Audit) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        with _outermost("collective") as outermost:
            if outermost:
                audit.collectives[name] = audit.collectives.get(name, 0) + 1
                tensors = [op.tensor for op in args[0]] if name == "batch_isend_irecv" else _tensors((args, kwargs))
                audit.off_device.extend(
                    f"{name} at {_caller()}: a {t.dtype} tensor of shape {tuple(t.shape)} made without device= "
                    "(on the host under CUDA)"
                    for t in tensors
                    if is_host(t)
                )
            return original(*args, **kwargs)

    collective.__wrapped__ = original  # type: ignore[attr-defined]
    return collective


@contextmanager
def audit_collectives(audit: Audit) -> Iterator[None]:
    """Wrap the collectives for the block (both ``torch.distributed`` and ``distributed_c10d`` names,
    so ``P2POp``'s check of its op still matches)."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in [*_COLLECTIVES, "batch_isend_irecv"]:
            original = getattr(c10d, name)
            wrapped = _checked(name, original, audit)
            for module in (dist, c10d):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
        for name in _FUNCOL:
            saved.append((funcol, name, getattr(funcol, name)))
            setattr(funcol, name, _checked(f"funcol.{name}", getattr(funcol, name), audit))
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


_READS = ["item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"]


@contextmanager
def audit_host_reads(audit: Audit) -> Iterator[None]:
    """Record every host read of a tensor in the block (see the module docstring)."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with _outermost("read") as outermost:
                if outermost:
                    audit.reads.append((audit.step, name, _caller()))
                return original(self, *args, **kwargs)

        return read

    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, counted(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextmanager
def placement_in_new_threads() -> Iterator[None]:
    """Threads started with ``threading.Thread`` in the block run under :class:`PlacementMode` too."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        with PlacementMode():
            original(self)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


class AuditCallback(pl.Callback):
    """In each rank: audit collectives and host reads from ``setup`` to ``teardown`` and write
    ``rank<r>.json`` into ``out``; note, per training step, whether metrics were logged at it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.audit = Audit()
        self._stack: ExitStack | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.audit = Audit()
        self._stack = ExitStack()
        for cm in (audit_collectives(self.audit), audit_host_reads(self.audit), placement_in_new_threads()):
            self._stack.enter_context(cm)
        self._stack.enter_context(PlacementMode())

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.audit.step = trainer.global_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        # inside the step, before the strategy's post-step hook: the same answer it gets
        self.audit.due[trainer.global_step] = log_due(trainer) is not None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.audit.step = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.audit.off_device.append("the fit raised: " + "".join(traceback.format_exception(exception))[-2000:])

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        self.audit.dump(self.out / f"rank{trainer.global_rank}.json")
