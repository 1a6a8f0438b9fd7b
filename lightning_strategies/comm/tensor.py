"""Intra-layer (tensor) model parallelism: ``nn.Linear`` layers split Megatron-style, without Lightning.

Shoeybi et al. 2019 (Megatron-LM, §3): a layer split by output features (column-parallel) followed by one split
by input features (row-parallel, partial products summed) costs one all-reduce each way; elementwise ops between
them work on the slices. Parameters are ``torch.distributed.tensor`` shards (optimizers and norms see whole
layers); only the activation collectives are ours: torch's redistributions, timed and counted
(:class:`TensorParallelStats`), installed with hook handles so :meth:`TensorParallelModule.unparallelize`
gives the module back whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.hooks import RemovableHandle

from lightning_strategies.comm.stats import CommStats

__all__ = [
    "ELEMENTWISE",
    "STYLES",
    "TensorParallelModule",
    "TensorParallelStats",
    "activation_bytes_per_step",
    "auto_plan",
    "check_plan",
    "full_tensor",
    "is_sharded",
    "local_part",
    "parallelize",
    "ring_all_reduce_bytes",
    "shard_full_tensor",
]

STYLES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gather")
"""``colwise``: output features split, the output stays split (a ``rowwise`` layer must take it);
``rowwise``: input features split, partial outputs all-reduced; ``colwise_gather``: output
features split, the output all-gathered (a layer with no partner)."""

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish,
    nn.Hardswish, nn.Identity, nn.Dropout,
)  # fmt: skip
"""Modules that may sit between a column- and a row-parallel layer: they act on each feature alone."""


def auto_plan(module: nn.Module) -> dict[str, str]:
    """The plan that splits every ``nn.Linear`` of ``module``.

    In each ``nn.Sequential``, a linear layer followed by another with only :data:`ELEMENTWISE` modules
    between forms a ``colwise`` / ``rowwise`` pair, left to right (``L1 L2 L3`` gives a pair and ``L3``
    alone); every linear layer left alone is ``colwise_gather``.
    """
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        if not isinstance(parent, nn.Sequential):
            continue
        children = list(parent.named_children())
        i = 0
        while i < len(children):
            name, child = children[i]
            if not isinstance(child, nn.Linear):
                i += 1
                continue
            j = i + 1
            while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                j += 1
            if j < len(children) and isinstance(children[j][1], nn.Linear):
                plan[_join(prefix, name)] = "colwise"
                plan[_join(prefix, children[j][0])] = "rowwise"
                i = j + 1
            else:
                i += 1
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear) and name not in plan:
            plan[name] = "colwise_gather"
    return plan


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_plan(module: nn.Module, plan: Mapping[str, str], tp_size: int) -> None:
    """Raise ``ValueError`` unless ``plan`` can split ``module`` over ``tp_size`` ranks: ``nn.Linear`` layers,
    :data:`STYLES`, split dimensions divisible by ``tp_size``, ``colwise`` and ``rowwise`` in pairs."""
    if not plan:
        raise ValueError(
            f"TensorParallelStrategy found an empty plan for {type(module).__name__}: expected at least one "
            "nn.Linear layer to split. Fix: add nn.Linear layers, name them in plan=..., or use strategy='ddp'."
        )
    modules = dict(module.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"TensorParallelStrategy plan: layer {name!r} has style {style!r}: expected one of "
                f"{', '.join(repr(s) for s in STYLES)}. Fix: use one of them."
            )
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            found = "no such module" if layer is None else f"a {type(layer).__name__}"
            raise ValueError(
                f"TensorParallelStrategy plan: found {found} at {name!r}: expected an nn.Linear. Fix: name one of "
                f"the module's linear layers ({', '.join(repr(n) for n in linears[:8]) or 'none'}"
                f"{', ...' if len(linears) > 8 else ''})."
            )
        dim, what = (layer.in_features, "in_features") if style == "rowwise" else (layer.out_features, "out_features")
        if dim % tp_size:
            kind = "row-parallel splits input features" if style == "rowwise" else "column-parallel splits outputs"
            raise ValueError(
                f"TensorParallelStrategy: layer {name!r} (Linear {layer.in_features} -> {layer.out_features}, "
                f"{style}) has {what}={dim}, not divisible by tp_size={tp_size} ({kind}). Fix: make {what} a "
                f"multiple of {tp_size}, pass a tp_size dividing {dim}, or leave {name!r} out of plan=... "
                "(it is then replicated)."
            )
    cols = sum(1 for s in plan.values() if s == "colwise")
    rows = sum(1 for s in plan.values() if s == "rowwise")
    if cols != rows:
        raise ValueError(
            f"TensorParallelStrategy plan: found {cols} 'colwise' and {rows} 'rowwise' layers: expected pairs, "
            "each 'colwise' layer's split output feeding one 'rowwise' layer. Fix: pair them, or make a lone "
            "layer 'colwise_gather'."
        )


def ring_all_reduce_bytes(payload: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: ``2 (n-1)/n x payload``."""
    return 2 * (group_size - 1) * payload // group_size if group_size > 1 else 0


def _all_gather_bytes(full_payload: int, group_size: int) -> int:
    return (group_size - 1) * full_payload // group_size if group_size > 1 else 0


def activation_bytes_per_step(
    module: nn.Module, plan: Mapping[str, str], *, rows: int, tp_size: int, itemsize: int = 4
) -> int:
    """Activation bytes one rank sends per training step (forward + backward), by formula.

    Per pair, the row layer's output (forward) and the column layer's input gradient (backward) are
    all-reduced; a ``colwise_gather`` layer all-reduces its input gradient and all-gathers its output.
    Counts the first layer's backward all-reduce too, which does not run for data inputs.

    Args:
        rows: samples per step on this rank (the replica's batch) times positions per sample.
    """
    modules = dict(module.named_modules())
    total = 0
    for name, style in plan.items():
        layer = modules[name]
        assert isinstance(layer, nn.Linear)
        if style in ("colwise", "colwise_gather"):
            total += ring_all_reduce_bytes(rows * layer.in_features * itemsize, tp_size)
        if style == "rowwise":
            total += ring_all_reduce_bytes(rows * layer.out_features * itemsize, tp_size)
        if style == "colwise_gather":
            total += _all_gather_bytes(rows * layer.out_features * itemsize, tp_size)
    return total


@dataclass
class TensorParallelStats:
    """The activation collectives of a tensor-parallel module, as this rank ran them.

    ``bytes_sent`` follows the ring model, not the backend's algorithm; ``seconds`` is host wall time
    including the wait (a lower bound on CUDA).

    Attributes:
        forward: the forward collectives (row layers' all-reduces, gathered outputs).
        backward: the backward all-reduces of the column layers' input gradients.
    """

    forward: CommStats = field(default_factory=CommStats)
    backward: CommStats = field(default_factory=CommStats)

    def total(self) -> CommStats:
        return self.forward + self.backward

    def pop(self) -> CommStats:
        """Forward + backward since the last call, then zeroed."""
        return self.forward.reset() + self.backward.reset()


def _settled(t: Tensor) -> Tensor:
    """``t`` with its collective finished.

    ``DTensor.to_local`` documents that after an asynchronous redistribution (``async_op=True``, as torch's own
    parallel styles use) it returns a tensor whose collective may still run, and that its ``wait()`` gives the
    finished tensor; a plain tensor has no ``wait``. So the documented method is called where it exists, without
    naming torch's private class for such tensors.
    """
    wait = getattr(t, "wait", None)
    return cast(Tensor, wait()) if callable(wait) else t


def _timed_replicate(t: DTensor, mesh: DeviceMesh, model: Callable[[int, int], int]) -> tuple[Tensor, CommStats]:
    """``t`` made whole on every rank (an all-reduce or all-gather), and that collective: ``model(payload bytes,
    ranks)`` bytes each way."""
    t0 = time.perf_counter()
    full = _settled(t.redistribute(mesh, (Replicate(),)).to_local())
    sent = model(full.numel() * full.element_size(), mesh.size())
    return full, CommStats(bytes_sent=sent, bytes_received=sent, calls=1, seconds=time.perf_counter() - t0)


class _ReplicateInput(torch.autograd.Function):
    """``DTensor.from_local(x, mesh, [Replicate()])`` whose backward all-reduce (Megatron's ``f``, summing a
    column-parallel layer's partial input gradients) is timed and counted."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: DeviceMesh, stats: TensorParallelStats) -> DTensor:
        ctx.mesh, ctx.stats = mesh, stats
        return DTensor.from_local(x.view_as(x), mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Tensor, None, None]:
        if not isinstance(grad, DTensor):
            return grad, None, None
        if not grad.placements[0].is_partial():
            return _settled(grad.to_local()), None, None
        local, comm = _timed_replicate(grad, ctx.mesh, ring_all_reduce_bytes)
        ctx.stats.backward += comm
        return local, None, None


class _StyleHooks:
    """Partitions a linear layer as torch's style does and installs timed input/output hooks."""

    src_data_rank: int | None = None  # each rank cuts its shard from its own copy

    def _install(self, module: nn.Module, mesh: DeviceMesh, stats: TensorParallelStats) -> list[RemovableHandle]:
        self._partition_linear_fn("", module, mesh)  # type: ignore[attr-defined]
        pre = module.register_forward_pre_hook(lambda mod, inputs: self._input(inputs, mesh, stats))
        post = module.register_forward_hook(lambda mod, inputs, out: self._output(out, mesh, stats))
        return [pre, post]

    def _input(self, inputs: tuple[Any, ...], mesh: DeviceMesh, stats: TensorParallelStats) -> tuple[Any, ...]:
        raise NotImplementedError

    def _output(self, out: DTensor, mesh: DeviceMesh, stats: TensorParallelStats) -> Tensor:
        raise NotImplementedError


class _TimedColwise(_StyleHooks, ColwiseParallel):
    """Column-parallel: weight and bias ``Shard(0)``; input replicated (gradient all-reduced in
    backward); output split on the last dim (``colwise``) or all-gathered (``colwise_gather``)."""

    def __init__(self, *, gather: bool) -> None:
        super().__init__()
        self.gather = gather

    def _input(self, inputs: tuple[Any, ...], mesh: DeviceMesh, stats: TensorParallelStats) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            return inputs
        if not torch.is_grad_enabled() or not x.requires_grad:
            return (DTensor.from_local(x, mesh, (Replicate(),), run_check=False), *inputs[1:])
        return (_ReplicateInput.apply(x, mesh, stats), *inputs[1:])

    def _output(self, out: DTensor, mesh: DeviceMesh, stats: TensorParallelStats) -> Tensor:
        if not self.gather:
            return out.to_local()
        full, comm = _timed_replicate(out, mesh, _all_gather_bytes)
        stats.forward += comm
        return full


class _TimedRowwise(_StyleHooks, RowwiseParallel):
    """Row-parallel: weight ``Shard(1)``, bias replicated; input split on the last dim; the partial
    outputs all-reduced in forward (Megatron's ``g``; its backward needs no communication)."""

    def _install(self, module: nn.Module, mesh: DeviceMesh, stats: TensorParallelStats) -> list[RemovableHandle]:
        self.desired_input_layouts = (Shard(-1),)
        return super()._install(module, mesh, stats)

    def _input(self, inputs: tuple[Any, ...], mesh: DeviceMesh, stats: TensorParallelStats) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            return inputs
        return (DTensor.from_local(x, mesh, (Shard(-1),), run_check=False), *inputs[1:])

    def _output(self, out: DTensor, mesh: DeviceMesh, stats: TensorParallelStats) -> Tensor:
        full, comm = _timed_replicate(out, mesh, ring_all_reduce_bytes)
        stats.forward += comm
        return full


class TensorParallelModule:
    """A module whose planned linear layers are split over a 1-D ``mesh`` (made by :func:`parallelize`).

    Attributes:
        module: the module, split in place.
        mesh: the tensor-parallel mesh (one dimension).
        plan: layer path -> style.
        stats: the activation collectives run since the last :meth:`TensorParallelStats.pop`.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
        self.module = module
        self.mesh = mesh
        self.plan = dict(plan)
        self.stats = TensorParallelStats()
        self._handles: list[RemovableHandle] = []
        modules = dict(module.named_modules())
        for name, style in self.plan.items():
            hooks = _TimedRowwise() if style == "rowwise" else _TimedColwise(gather=style == "colwise_gather")
            self._handles += hooks._install(modules[name], mesh, self.stats)

    @property
    def tp_size(self) -> int:
        return self.mesh.size()

    def unparallelize(self) -> nn.Module:
        """Every ``DTensor`` parameter back to a plain full one, hooks removed (a collective over the group)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod in self.module.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if isinstance(p, DTensor):
                    full = _settled(p.full_tensor()).detach().clone()
                    mod.register_parameter(name, nn.Parameter(full, requires_grad=p.requires_grad))
        return self.module


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str]) -> TensorParallelModule:
    """Split ``module``'s planned linear layers over ``mesh`` in place (check the plan with :func:`check_plan`).

    Every rank of ``mesh`` must hold the same weights: each cuts its shards from its own copy.
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize: found a {mesh.ndim}-D mesh: expected the 1-D tensor-parallel mesh.")
    return TensorParallelModule(module, mesh, plan)


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` split over its mesh (some ``Shard`` placement)."""
    return isinstance(t, DTensor) and any(p.is_shard() for p in t.placements)


def local_part(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: Tensor, *, dst: int | None = 0) -> Tensor | None:
    """The whole tensor of ``t`` (a ``DTensor``) on group rank ``dst`` only, else ``None`` (``dst=None``: on
    every rank); a collective over ``t``'s mesh. Plain tensors come back as they are."""
    if not isinstance(t, DTensor):
        return t
    if dst is None or not is_sharded(t):
        return _settled(t.full_tensor()) if dst is None else _settled(t.to_local())
    mesh = t.device_mesh
    group = mesh.get_group()
    dim = next(p.dim for p in t.placements if p.is_shard())  # type: ignore[attr-defined]
    local = _settled(t.to_local()).contiguous()
    parts = [torch.empty_like(local) for _ in range(mesh.size())] if dist.get_rank(group) == dst else None
    dist.gather(local, parts, group=group, group_dst=dst)
    return torch.cat(parts, dim=dim) if parts is not None else None


def shard_full_tensor(full: Tensor, like: DTensor) -> DTensor:
    """``full`` (the whole tensor, on every rank) split as ``like`` is, without communication."""
    full = full.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
