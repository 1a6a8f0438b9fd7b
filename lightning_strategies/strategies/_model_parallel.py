"""What ``pipeline`` and ``tensor`` share: a model split over a group of ranks, replicated on a (dp, <axis>) mesh."""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.strategies._base import StrategyBase, divisors

__all__ = ["GroupNormClipping", "GroupNormPrecision", "ModelParallelStrategy", "destroy_at_exit", "forget_at_exit"]

_GROUPS_AT_EXIT: list[dist.ProcessGroup] = []


def destroy_at_exit(groups: Iterable[dist.ProcessGroup]) -> None:
    """Destroy ``groups`` at interpreter exit: a gloo group left to its teardown may abort a process that did fine."""
    if not _GROUPS_AT_EXIT:
        atexit.register(_destroy_groups_at_exit)
    _GROUPS_AT_EXIT.extend(g for g in groups if g not in _GROUPS_AT_EXIT)


def forget_at_exit(groups: Iterable[dist.ProcessGroup]) -> None:
    """Leave ``groups`` to the process's end after all (destroying one waits for work a dead peer never completes)."""
    for group in groups:
        with suppress(ValueError):
            _GROUPS_AT_EXIT.remove(group)


def _destroy_groups_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        for group in _GROUPS_AT_EXIT:
            with suppress(Exception):  # destroyed already, or the default group went first
                dist.destroy_process_group(group)
    _GROUPS_AT_EXIT.clear()


class ModelParallelStrategy(StrategyBase):
    """A model split over ``model_parallel_size`` ranks (``None``: the world), replicated ``replicas`` times;
    subclasses name their mesh axis (:attr:`mesh_axis`) and size option (:attr:`size_option`)."""

    wraps_ddp = False
    mesh_axis: ClassVar[str]
    size_option: ClassVar[str]

    def __init__(self, *args: Any, model_parallel_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model_parallel_size = model_parallel_size
        self._mesh: DeviceMesh | None = None
        self._sync_replicas = True

    @property
    def model_parallel_size(self) -> int:
        """Ranks that share one copy of the model: the size option, or the world size."""
        return self._model_parallel_size if self._model_parallel_size is not None else max(1, self.world_size)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the split model, ``world size / model_parallel_size``."""
        return max(1, self.world_size // self.model_parallel_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shards over replicas only: every rank of a model-parallel group must see the same batches.
        return {"num_replicas": self.replicas, "rank": self._replica_rank()}

    def _replica_rank(self) -> int:
        return self.global_rank // self.model_parallel_size

    @override
    def _configure_launcher(self) -> None:
        # called in the launching process once the world size is known: fail before any process starts
        self._check_world()
        super()._configure_launcher()

    def _check_world(self) -> None:
        """Raise unless the world is ``replicas x model_parallel_size``; subclasses add their checks."""
        world, size, option = self.world_size, self.model_parallel_size, self.size_option
        if world % size:
            raise ValueError(
                f"{type(self).__name__}({option}={size}) with a world size of {world} processes: the world "
                f"size must be replicas x {option}, and {world} is not a multiple of {size}. Fix: pass "
                f"{option} dividing {world} (e.g. {', '.join(str(d) for d in divisors(world))}), or run "
                f"a multiple of {size} processes (devices x num_nodes)."
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the world process group
        self._check_world()
        if self._mesh is None:  # a strategy that keeps its mesh across fit and test reuses it
            self._mesh = self._init_mesh((self.replicas, self.model_parallel_size), ("dp", self.mesh_axis))

    def _group(self, axis: str) -> dist.ProcessGroup | None:
        return self._mesh.get_group(axis) if self._mesh is not None else None

    def _own_groups(self, *more: dist.ProcessGroup) -> list[dist.ProcessGroup]:
        """This rank's groups of the mesh and ``more``, each once, the default (world) group left out."""
        if self._mesh is None or not (dist.is_available() and dist.is_initialized()):
            return []
        groups: list[dist.ProcessGroup] = []
        for group in (self._mesh.get_group(self.mesh_axis), self._mesh.get_group("dp"), *more):
            if group is not dist.GroupMember.WORLD and group not in groups:
                groups.append(group)
        return groups

    @override
    def on_train_end(self) -> None:
        # The split state goes at teardown: keep the full optimizer state for a save_checkpoint after fit.
        self._keep_state_at_fit_end()
        super().on_train_end()

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning wraps accumulate-only micro-steps in this (as DDP's no_sync); the last one averages the sum
        self._sync_replicas = False
        try:
            yield None
        finally:
            self._sync_replicas = True


class GroupNormClipping:
    """Clipping by the norm of the whole (split) model, for a precision plugin (a mixin).

    Squared norms of the gradients this rank alone holds are summed over ``group`` (replicated ones count once)
    by every rank, gradients or not, on the gradients' device (an NCCL group has no CPU backend).

    Args:
        group: returns the model-parallel process group (``None`` before it exists).
        device: returns the device of the all-reduced norm (the strategy's ``root_device``).
        is_split: whether a gradient is held by this rank alone; default every gradient.
        local: the tensor this rank holds for a gradient (a DTensor's local shard); default itself.
    """

    def __init__(
        self,
        group: Callable[[], dist.ProcessGroup | None],
        device: Callable[[], torch.device],
        *args: Any,
        is_split: Callable[[Tensor], bool] = lambda g: True,
        local: Callable[[Tensor], Tensor] = lambda g: g,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._group = group
        self._device = device
        self._is_split = is_split
        self._local = local

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Scale this rank's gradients by ``min(1, clip_val / (norm + 1e-6))``, the norm of the whole model's."""
        grads = [p.grad for p in Precision.main_params(cast(Precision, self), optimizer) if p.grad is not None]
        parts = [self._local(g) for g in grads]
        device = self._device()
        split = torch.zeros((), dtype=torch.float64, device=device)
        shared = torch.zeros((), dtype=torch.float64, device=device)
        for g, part in zip(grads, parts, strict=True):
            squares = part.detach().double().pow(2).sum().to(device)
            if self._is_split(g):
                split += squares
            else:
                shared += squares
        group = self._group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(split, group=group)
        # torch.nn.utils.clip_grad_norm_'s rule: scale by clip / (norm + 1e-6), never up; on the
        # device, always applied (a factor of 1 included), so the host never waits for the norm
        coef = (float(clip_val) / ((split + shared).sqrt() + 1e-6)).clamp(max=1.0)
        if parts:
            torch._foreach_mul_(parts, coef)


class GroupNormPrecision(GroupNormClipping, Precision):
    """32-bit precision clipping by the whole model's norm (:class:`GroupNormClipping`, its arguments)."""
