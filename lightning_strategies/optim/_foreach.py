"""The layer-wise machinery :class:`~lightning_strategies.optim.Lamb` and :class:`~lightning_strategies.optim.Lars`
share: torch's optimizer conventions, the ``foreach`` decision, CPU cache blocking, norms and validation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT
from typing_extensions import Self

__all__: list[str] = []

# Devices whose tensors the ``torch._foreach_*`` ops accept (CPU runs them as a C++ loop
# over the per-tensor kernels, CUDA/XPU as fused multi-tensor kernels).
_FOREACH_DEVICES = ("cpu", "cuda", "xpu")
_FOREACH_TYPES = (Tensor, torch.nn.Parameter)


class _LayerwiseOptimizer(Optimizer):
    """The torch conventions Lamb and Lars share. Options an older checkpoint may lack, every keyword-only one of the
    constructor and ``layer_adaptation``, are filled in at their defaults, so old optimizer states load."""

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        defaults = {**defaults, "layer_adaptation": True}  # a param group may turn it off
        # the constructor's values are checked first, so their errors name no param group
        self._validate_group(defaults, where="")
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any], *, where: str) -> None:
        """Raise ``ValueError`` for an invalid hyperparameter of ``group`` (message prefixed by ``where``): the
        options both optimizers have here, the others in :meth:`_validate_options`."""
        for key, what in (("lr", "learning rate"), ("eps", "epsilon value"), ("weight_decay", "weight_decay value")):
            value = group[key]
            _require_valid(_is_real_number(value) and value >= 0.0, what, value, f"a float >= 0 ({key}=...)", where)
        for key in ("trust_clip", "layer_adaptation", *self._flags):
            _require_valid(isinstance(group[key], bool), f"{key} value", group[key], "True or False", where)
        foreach = group["foreach"]
        _require_valid(foreach in (None, True, False), "foreach value", foreach, "None, True or False", where)
        self._validate_options(group, where=where)

    #: The subclass's own ``bool`` options.
    _flags: tuple[str, ...] = ()

    def _validate_options(self, group: dict[str, Any], *, where: str) -> None:
        """Raise ``ValueError`` for an invalid value of an option only this optimizer has."""
        raise NotImplementedError

    def _update(self) -> None:
        """Update every param group's parameters from their gradients (called under ``no_grad``)."""
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        options = inspect.signature(type(self).__init__).parameters.values()
        later = {p.name: p.default for p in options if p.kind is p.KEYWORD_ONLY} | {"layer_adaptation": True}
        for group in [self.defaults, *self.param_groups]:
            for key, value in later.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add ``param_group`` as torch does (keys it lacks take the constructor's values), then validate it:
        ``ValueError`` for an invalid hyperparameter or a complex parameter (the group is not added)."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._validate_group(self.param_groups[index], where=f"param group {index}: ")
            _refuse_complex_params(type(self).__name__, self.param_groups[index]["params"], index)
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step; returns the loss of ``closure`` (called with grad enabled), if given
        (``RuntimeError`` for a sparse gradient)."""
        loss = self._begin_step(closure)
        self._update()
        return loss

    def _begin_step(self, closure: Callable[[], float] | None) -> float | None:
        """The loss of the step's ``closure`` (called with grad enabled; ``None`` without one), then every group
        checked for sparse gradients before any is updated: an error leaves no half-applied step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _refuse_sparse_grads(type(self).__name__, [p for g in self.param_groups for p in g["params"]])
        return loss


@dataclass(frozen=True)
class _GroupOptions:
    """A param group's hyperparameters as plain Python scalars, read once per step: each field is the group's key
    of that name, as a ``bool`` or a ``float`` (its annotation)."""

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> Self:
        return cls(**{f.name: bool(group[f.name]) if f.type == "bool" else float(group[f.name]) for f in fields(cls)})


# ---- the foreach decision, norms, the global clip factor ----------------------------------


def _use_foreach(foreach: bool | None, params: Iterable[Tensor]) -> bool:
    if foreach is not None:
        return bool(foreach)
    if torch.jit.is_scripting():
        return False
    return all(type(p) in _FOREACH_TYPES and p.device.type in _FOREACH_DEVICES for p in params)


def _group_by_device_and_dtype(
    tensor_lists: Sequence[Sequence[Any]],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[list[Any]], list[int]]]:
    """Index ``i`` of every list, grouped by the device and dtype of ``tensor_lists[0][i]``, with the indices.

    The grouping torch's own foreach optimizers do (each ``torch._foreach_*`` call takes one device and dtype),
    written here rather than borrowed from ``Optimizer``'s private helper. The other lists follow the first
    (their entries may be ``None``, or step counters on another device); groups come in order of first appearance.
    """
    out: dict[tuple[torch.device, torch.dtype], tuple[list[list[Any]], list[int]]] = {}
    for i, first in enumerate(tensor_lists[0]):
        lists, indices = out.setdefault((first.device, first.dtype), ([[] for _ in tensor_lists], []))
        for dst, src in zip(lists, tensor_lists, strict=True):
            dst.append(src[i])
        indices.append(i)
    return out


def _norm_dtype(t: Tensor) -> torch.dtype:
    """Norms in float32 (float64 for float64 tensors): bf16/fp16 sums of squares lose too much."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _global_clip_factor(grads: list[Tensor], max_norm: float, *, foreach: bool, total: Tensor | None = None) -> Tensor:
    """``min(1, max_norm / ||grads||)`` over all tensors, a 0-dim float32 tensor (no host sync).

    ``total``: the norm when the caller knows it (a parameter-server shard holds a part of the gradients).
    """
    if total is not None:
        total = total.to(device=grads[0].device, dtype=_norm_dtype(grads[0]))
        return torch.where(total > max_norm, max_norm / total, torch.ones_like(total))
    if foreach:
        # grouped by device and dtype, then put back in parameter order (the same sum as below)
        norms: list[Tensor] = [torch.empty(0)] * len(grads)
        grouped = _group_by_device_and_dtype([grads])
        for (device_grads,), indices in grouped.values():
            dev = cast(list[Tensor], device_grads)
            for i, n in zip(indices, torch._foreach_norm(dev, 2, dtype=_norm_dtype(dev[0])), strict=True):
                norms[i] = n
    else:
        norms = [torch.linalg.vector_norm(g, dtype=_norm_dtype(g)) for g in grads]
    device = norms[0].device
    dtype = torch.float64 if all(n.dtype == torch.float64 for n in norms) else torch.float32
    total = torch.linalg.vector_norm(torch.stack([n.to(device=device, dtype=dtype) for n in norms]))
    return torch.where(total > max_norm, max_norm / total, torch.ones_like(total))


# ---- CPU cache blocking of the multi-tensor paths -----------------------------------------

# On CPU the foreach ops are a C++ loop over the per-tensor kernels, so an op over a whole list streams every tensor
# through memory once per op (ResNet-50: ~100 MB per op), and each op that returns new tensors page-faults in fresh
# memory of that size. Units of at most this many elements (runs of whole tensors; a larger tensor alone, in chunks)
# stay in cache across all of their ops and keep temporaries small. GPUs fuse a list into few launches: no blocking.
CPU_BLOCK_ELEMENTS = 1 << 19


def _cache_block_elements(device: torch.device) -> int | None:
    # read at call time, so a test can shrink CPU_BLOCK_ELEMENTS to exercise the chunking
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else None


class _CacheUnit:
    """Parallel tensor lists of *views*: a run of whole tensors, or one tensor's flat chunks (``chunked``).

    Attributes:
        tensor_indices: the tensors' positions in the original lists (one position when chunked).
        op_slices: the slices to run each op on: all of a run, one chunk at a time of a chunked tensor.
    """

    def __init__(self, tensor_indices: list[int], tensor_lists: list[list[Tensor]], chunked: bool) -> None:
        self.tensor_indices = tensor_indices
        self.chunked = chunked
        self.tensor_lists = tensor_lists
        n = len(tensor_lists[0])
        self.op_slices = [slice(j, j + 1) for j in range(n)] if chunked else [slice(0, n)]

    def select_for_views(self, list_values: Sequence[Any]) -> list[Any]:
        """One value per view, from ``list_values`` (one per tensor of the original lists)."""
        return self.expand_to_views([list_values[i] for i in self.tensor_indices])

    def expand_to_views(self, unit_values: Sequence[Any]) -> list[Any]:
        """One value per view, from ``unit_values`` (one per tensor of this unit): repeated over chunks."""
        return [unit_values[0]] * len(self.tensor_lists[0]) if self.chunked else list(unit_values)

    def tensor_norms(self, view_norms: list[Tensor]) -> Tensor:
        """The unit's tensors' norms (1-D) from its views' norms: sqrt(sum of squares) over chunks."""
        stacked = torch.stack(view_norms)
        return stacked.square().sum().sqrt().reshape(1) if self.chunked else stacked


def _split_into_cache_units(tensor_lists: list[list[Tensor]]) -> list[_CacheUnit]:
    """Split parallel tensor lists (on one device) into units of at most ``CPU_BLOCK_ELEMENTS`` elements on CPU,
    one unit of everything elsewhere.

    A larger contiguous tensor is a unit alone, in chunks; a non-contiguous one (channels_last) cannot be viewed flat
    and joins a run whole.
    """
    n = len(tensor_lists[0])
    block = _cache_block_elements(tensor_lists[0][0].device)
    if block is None:
        return [_CacheUnit(list(range(n)), [list(t) for t in tensor_lists], False)]
    units: list[_CacheUnit] = []
    run: list[int] = []
    size = 0

    def flush() -> None:
        if run:
            units.append(_CacheUnit(list(run), [[t[i] for i in run] for t in tensor_lists], False))
            run.clear()

    for i in range(n):
        numel = tensor_lists[0][i].numel()
        parallel = [t[i] for t in tensor_lists]
        if numel > block and all(t.is_contiguous() for t in parallel):
            flush()
            size = 0
            chunks = [list(t.view(-1).split(block)) for t in parallel]
            units.append(_CacheUnit([i], chunks, True))
            continue
        if run and size + numel > block:
            flush()
            size = 0
        run.append(i)
        size += numel
    flush()
    return units


# ---- refusals and validation ----------------------------------------------------------------


def _refuse_sparse_grads(name: str, params: Iterable[Tensor]) -> None:
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(
                f"{name} does not support sparse gradients: found a sparse gradient for a parameter "
                f"of shape {tuple(p.shape)}; expected dense gradients. Use nn.Embedding(sparse=False) "
                "or torch.optim.SparseAdam for that parameter."
            )


def _refuse_complex_params(name: str, params: Iterable[Tensor], group: int) -> None:
    for p in params:
        if torch.is_complex(p):
            raise ValueError(
                f"{name} does not support complex parameters: found a {p.dtype} tensor of shape "
                f"{tuple(p.shape)} in param group {group}; expected real floating-point tensors. "
                "Optimise torch.view_as_real(p) (a real parameter) instead."
            )


def _require_valid(ok: bool, what: str, value: object, expected: str, where: str) -> None:
    """Raise torch's ``ValueError("Invalid <what>: <value>; expected <expected>.")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{where}Invalid {what}: {value!r}; expected {expected}.")


def _is_real_number(value: object) -> bool:
    """Whether ``value`` is an int or float (a bool is not, though Python counts it as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
