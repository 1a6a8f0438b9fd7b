"""What a shard needs to rebuild the worker's optimizer over its own tensors."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OptimizerSpec", "hyperparameters"]


@dataclass(frozen=True)
class OptimizerSpec:
    """The worker optimizer's class, ``defaults`` and param groups: a shard builds
    ``optimizer_class(groups, **defaults)`` over its own tensors (by :mod:`torch.optim`'s convention
    ``defaults`` holds exactly the constructor's keywords).

    Attributes:
        group_options: per param group, its hyperparameters (every key but ``"params"``).
        group_sizes: per param group, how many tensors it holds.
    """

    optimizer_class: type[Optimizer]
    defaults: dict[str, Any]
    group_options: tuple[dict[str, Any], ...]
    group_sizes: tuple[int, ...]

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer) -> OptimizerSpec:
        """Describe ``optimizer``, checking (over one scalar per group) that a shard can rebuild it: a
        constructor that needs more than ``(params, **defaults)`` fails at setup, not on a server mid-run.

        Raises:
            TypeError: when the class is not a :class:`torch.optim.Optimizer` or cannot be rebuilt from ``defaults``.
        """
        opt_cls = type(optimizer)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"The parameter server runs the optimizer on the servers and rebuilds it there; found "
                f"{opt_cls.__qualname__}, which is not a torch.optim.Optimizer. Expected a subclass of "
                "torch.optim.Optimizer whose constructor is `(params, **optimizer.defaults)`. Fix: return "
                "such an optimizer from configure_optimizers, or use strategy='ddp'."
            )
        spec = cls(
            optimizer_class=opt_cls,
            defaults=dict(optimizer.defaults),
            group_options=tuple(hyperparameters(g) for g in optimizer.param_groups),
            group_sizes=tuple(len(g["params"]) for g in optimizer.param_groups),
        )
        probes = {i: torch.zeros(1, requires_grad=True) for i in _group_starts(spec.group_sizes)}
        spec.build(probes)
        return spec

    @property
    def elementwise(self) -> bool:
        """Whether each element's update depends on that element alone, so a tensor may be split across
        servers. Layer-wise optimizers (LAMB, LARS: a trust ratio from the whole tensor's norms) and any
        class not in :data:`ELEMENTWISE_OPTIMIZERS` keep whole tensors."""
        return self.optimizer_class in ELEMENTWISE_OPTIMIZERS

    def group_of(self, flat_index: int) -> int:
        """The param group of the tensor at ``flat_index`` in the optimizer's parameter order."""
        end = 0
        for g, n in enumerate(self.group_sizes):
            end += n
            if flat_index < end:
                return g
        raise IndexError(f"flat index {flat_index} is past the optimizer's {end} tensors")

    def _constructor_defaults(self) -> dict[str, Any]:
        """``defaults`` less any key the constructor does not take (LAMB's ``layer_adaptation``): safe,
        since every group passed to the constructor carries the worker group's value of every option."""
        try:
            parameters = inspect.signature(self.optimizer_class.__init__).parameters
        except (TypeError, ValueError):
            return dict(self.defaults)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return dict(self.defaults)
        return {k: v for k, v in self.defaults.items() if k in parameters}

    def build(self, params: Mapping[int, Tensor] | Sequence[tuple[int, Tensor]]) -> Optimizer | None:
        """Build the optimizer over ``params``; ``None`` when empty. Groups with no tensor here are left
        out (torch optimizers reject empty groups).

        Args:
            params: flat index -> tensor, or (flat index, tensor) pairs in flat order (several
                slices of one tensor share its index).

        Raises:
            TypeError: when the class cannot be rebuilt from ``(param_groups, **defaults)``.
        """
        items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
        if not items:
            return None
        groups: list[dict[str, Any]] = []
        for g in range(len(self.group_sizes)):
            members = [t for i, t in items if self.group_of(i) == g]
            if members:
                groups.append({**self.group_options[g], "params": members})
        try:
            return self.optimizer_class(groups, **self._constructor_defaults())
        except Exception as err:
            try:
                signature = str(inspect.signature(self.optimizer_class.__init__))
            except (TypeError, ValueError):
                signature = "(unknown signature)"
            raise TypeError(
                f"The parameter server could not rebuild the optimizer on a server: found "
                f"{self.optimizer_class.__qualname__}{signature}, and "
                f"`{self.optimizer_class.__qualname__}(param_groups, **defaults)` with keywords "
                f"{sorted(self._constructor_defaults())} raised {type(err).__name__}: {err}. Expected a torch.optim "
                "optimizer whose `defaults` are exactly its constructor keywords (every torch.optim "
                "class and lightning_strategies.optim.Lamb are). Fix: make the constructor accept "
                "`(params, **defaults)` (keep extra state out of __init__), or use strategy='ddp'."
            ) from err


# exact classes (see OptimizerSpec.elementwise): a subclass may change step()
ELEMENTWISE_OPTIMIZERS: frozenset[type[Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
    }
)

# per-tensor lists of a param group, not hyperparameters: a shard holds a subset of the tensors
_PER_TENSOR_KEYS = ("params", "param_names")


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (every key but its per-tensor lists)."""
    return {k: v for k, v in group.items() if k not in _PER_TENSOR_KEYS}


def _group_starts(group_sizes: Sequence[int]) -> list[int]:
    """The flat index of each non-empty group's first tensor."""
    return [start for start, n in zip(itertools.accumulate(group_sizes, initial=0), group_sizes, strict=False) if n]
