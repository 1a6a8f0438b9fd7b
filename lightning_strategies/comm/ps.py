"""Sharded parameter servers over :mod:`torch.distributed.rpc`, with no Lightning import.

The trainable tensors of a model, flattened in the optimizer's order, are cut into
``num_servers`` contiguous ranges of equal size (:func:`partition_parameters`, BytePS-style: a
tensor may span servers), so every server carries the same bytes however unequal the tensors.
A layer-wise optimizer (LAMB, LARS), whose trust ratio needs a whole tensor's norms, gets whole
tensors per server instead (:func:`shard_parameters`, balanced by size). Shards are co-located
with the training processes: rank ``r`` hosts shard ``r`` for ``r < num_servers``. Each shard
owns a copy of its slices and an instance of the user's optimizer rebuilt from an
:class:`OptimizerSpec` (same class, same hyperparameters per group, each slice in its tensor's
group), so the optimizer *runs on the servers*; workers only push gradients and pull values.

One step of a worker (:meth:`ParameterServerClient.push_pull`) sends each shard its slices of
the gradients as one flat tensor (:class:`Packed`, one per dtype) together with the worker's
current learning rates (so LR schedulers and warmup on the worker keep working), to all shards
in parallel with ``rpc_async``, and copies the answer (one flat tensor likewise) into the local
parameters.

A shard is a barrier: it keeps every worker's push for the step, and when the last worker's
push arrives it averages the gradients (divide by the number of workers, then sum in worker
order, as DDP's reducer does), takes one optimizer step and answers every worker with the new
values. That is DDP's arithmetic with the optimizer moved to the server. The RPC handler is
``@rpc.functions.async_execution``: it returns a future at once instead of blocking an RPC
thread until the barrier opens, so a handful of RPC threads serve any number of workers (a
blocking handler deadlocks once the waiting pushes occupy every thread). The asynchronous
variant (:mod:`.async_ps`) builds on the shard and client here; the RPC plumbing is :mod:`.rpc`.

On a GPU the tensors stay on the device and TensorPipe moves them directly (the strategy sets
its device maps). The shard's work is ordered by :class:`~lightning_strategies.comm.streams.StreamOrder`:
the step runs on the shard's own stream after the streams the gradients came on, and every reply
is a *snapshot* (a copy packed on that stream, never the live parameters) handed out through a
stream-aware future, so the device follows the order the shard's lock gives the host. This was
chosen over staging the traffic through pinned CPU buffers, which would add a device-to-host copy
and a host wait to every push and reply; ``benchmarks/ps_snapshot.py`` measures what a snapshot
costs (on CPU, mostly the first touch of its fresh memory).

Bytes are counted as payload (tensor bytes), for the worker (``bytes_sent`` = gradients pushed,
``bytes_received`` = values pulled) and for the shard (``bytes_received`` = gradients,
``bytes_sent`` = values). A worker calls its own co-located shard directly instead of through
RPC (no serialisation); its payload still counts, so the counts measure the algorithm, not the
transport.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.futures import Future
from torch.optim import Optimizer

from lightning_strategies.comm.rpc import (
    ShardError,
    call_host,
    completed,
    hosted_shard,
    is_failure,
    local_shard,
    wait_reply,
    worker_name,
)
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.comm.streams import StreamBackend, StreamOrder

__all__ = [
    "PARTITION_ALIGN",
    "OptimizerSpec",
    "ParameterServerClient",
    "ParameterShard",
    "ShardReply",
    "Slice",
    "broadcast_from_rank0",
    "partition_loads",
    "partition_parameters",
    "payload_bytes",
    "shard_loads",
    "shard_parameters",
    "whole_tensor_slices",
]


# --------------------------------------------------------------------------------------------
# Sharding plan
# --------------------------------------------------------------------------------------------


class Slice(NamedTuple):
    """Elements ``[start, stop)`` of the flattened tensor ``tensor`` (the optimizer's parameter order).

    A slice covering its whole tensor keeps the tensor's shape on the shard; a part of a tensor is
    held flat (1-D).
    """

    tensor: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


# Partition boundaries inside a tensor fall on multiples of this many elements from the tensor's
# start, so a slice's elements sit in the same lanes of the CPU's vector loops as in the whole
# tensor (the elementwise optimizer kernels then round exactly as on one device).
PARTITION_ALIGN = 64


def partition_parameters(sizes: Sequence[int], num_servers: int, *, align: int = PARTITION_ALIGN) -> list[list[Slice]]:
    """Split the flattened parameters into ``num_servers`` contiguous ranges of (almost) equal size.

    The tensors are laid end to end in the optimizer's order (``N = sum(sizes)`` elements) and
    cut at ``s * N / num_servers`` for ``s = 1 .. num_servers - 1``, each cut moved to the nearest
    multiple of ``align`` elements from the start of the tensor it falls in (or that tensor's end).
    A tensor may thus span servers (BytePS-style); each server's elements differ from ``N / S`` by
    at most ``align``. The plan depends only on ``sizes``, so every rank computes the same one.

    Args:
        sizes: number of elements of each tensor, in the optimizer's parameter order.
        num_servers: number of shards.
        align: granularity of a cut inside a tensor, in elements.

    Returns:
        For each shard, its slices in flat order. A zero-size tensor goes whole to the shard
        whose range holds its offset. A shard may be empty when ``N < num_servers * align``.

    Raises:
        ValueError: when ``num_servers`` or ``align`` < 1, or a size is negative.
    """
    _check_plan_args(sizes, num_servers)
    if align < 1:
        raise ValueError(f"align must be >= 1 element, found {align}")
    starts = list(itertools.accumulate(sizes, initial=0))
    total = starts[-1]

    def snap(t: int) -> int:
        j = bisect.bisect_right(starts, t) - 1  # the tensor holding element t (t < total): not empty
        off = t - starts[j]
        down = off - off % align
        up = min(down + align, sizes[j])
        return starts[j] + (down if off - down <= up - off else up)

    cuts = [0]
    for s in range(1, num_servers):
        ideal = (s * total + num_servers // 2) // num_servers  # s * N / S, rounded
        cuts.append(max(cuts[-1], snap(ideal) if ideal < total else total))
    cuts.append(total)
    plan: list[list[Slice]] = [[] for _ in range(num_servers)]
    for i, n in enumerate(sizes):
        lo, hi = starts[i], starts[i] + n
        if n == 0:
            plan[min(bisect.bisect_right(cuts, lo) - 1, num_servers - 1)].append(Slice(i, 0, 0))
            continue
        first = bisect.bisect_right(cuts, lo) - 1
        for s in range(first, num_servers):
            a, b = max(lo, cuts[s]), min(hi, cuts[s + 1])
            if a >= hi:
                break
            if a < b:
                plan[s].append(Slice(i, a - lo, b - lo))
    return plan


def whole_tensor_slices(plan: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[list[Slice]]:
    """A whole-tensor plan (:func:`shard_parameters`) as slices, one per tensor."""
    return [[Slice(i, 0, sizes[i]) for i in shard] for shard in plan]


def partition_loads(plan: Sequence[Sequence[Slice]]) -> list[int]:
    """Elements held by each shard of a partition."""
    return [sum(sl.numel for sl in shard) for shard in plan]


def _check_plan_args(sizes: Sequence[int], num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, found {num_servers}; pass a positive shard count")
    if any(s < 0 for s in sizes):
        raise ValueError(f"tensor sizes must be >= 0, found {[s for s in sizes if s < 0]}")


def shard_parameters(sizes: Sequence[int], num_servers: int) -> list[list[int]]:
    """Assign whole tensors to shards, balancing the number of elements per shard.

    The plan for optimizers that need whole tensors (a layer-wise trust ratio: LAMB, LARS);
    :func:`partition_parameters` balances better and is used for elementwise optimizers.
    Longest-processing-time greedy: tensors from largest to smallest (ties by index) each go to
    the shard with the fewest elements so far (ties by shard index). The busiest shard holds at
    most ``4/3`` of the optimum, and at most ``mean + largest tensor``: on ResNet-50 at 64 shards
    that is ~6x the mean, since one tensor alone holds 2.36M of 25.6M elements. The plan depends
    only on ``sizes`` and ``num_servers``, so every process computes the same plan without talking.

    Args:
        sizes: number of elements of each tensor, in the optimizer's parameter order.
        num_servers: number of shards.

    Returns:
        For each shard, the sorted indices (into ``sizes``) of the tensors it holds. A shard
        may be empty when there are fewer tensors than shards.

    Raises:
        ValueError: when ``num_servers`` < 1 or a size is negative.
    """
    _check_plan_args(sizes, num_servers)
    loads = [0] * num_servers
    plan: list[list[int]] = [[] for _ in range(num_servers)]
    for idx in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(num_servers), key=lambda s: (loads[s], s))
        plan[target].append(idx)
        loads[target] += sizes[idx]
    return [sorted(p) for p in plan]


def shard_loads(sizes: Sequence[int], plan: Sequence[Sequence[int]]) -> list[int]:
    """Elements held by each shard of a whole-tensor ``plan``."""
    return [sum(sizes[i] for i in shard) for shard in plan]


# --------------------------------------------------------------------------------------------
# Rebuilding the user's optimizer on a shard
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """What a shard needs to rebuild the worker's optimizer over its own tensors.

    The convention of :mod:`torch.optim` is that ``optimizer.defaults`` holds exactly the
    constructor's keyword arguments, and each param group holds its own values of them; a shard
    builds ``optimizer_class(groups, **defaults)`` where ``groups`` keeps, per group of the
    worker's optimizer, the tensors this shard holds and that group's hyperparameters.

    Attributes:
        optimizer_class: the class of the worker's optimizer.
        defaults: the worker optimizer's ``defaults`` (its constructor keywords).
        group_options: per param group, its hyperparameters (every key but ``"params"``).
        group_sizes: per param group, how many tensors it holds (flat index ``i`` belongs to
            the group whose cumulative size first exceeds ``i``).
    """

    optimizer_class: type[Optimizer]
    defaults: dict[str, Any]
    group_options: tuple[dict[str, Any], ...]
    group_sizes: tuple[int, ...]

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer) -> OptimizerSpec:
        """Describe ``optimizer`` and check at once that a shard can rebuild it.

        The check builds the class over one scalar tensor per group, so a constructor that
        needs more than ``(params, **defaults)`` fails here, when the strategy is set up, and
        not on a server mid-run.

        Raises:
            TypeError: when the class is not a :class:`torch.optim.Optimizer` or cannot be
                rebuilt from its ``defaults``.
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
            group_options=tuple(_group_options(g) for g in optimizer.param_groups),
            group_sizes=tuple(len(g["params"]) for g in optimizer.param_groups),
        )
        probes = {i: torch.zeros(1, requires_grad=True) for i in _group_starts(spec.group_sizes)}
        spec.build(probes)
        return spec

    @property
    def elementwise(self) -> bool:
        """Whether the optimizer's update of an element depends on that element alone.

        Then a tensor may be split across servers, each part optimized as a parameter of its own
        (momentum and Adam moments are per element; a step count is the same for every part).
        Layer-wise optimizers (LAMB, LARS: a trust ratio from the whole tensor's norms) and any
        class not listed in :data:`ELEMENTWISE_OPTIMIZERS` keep whole tensors.
        """
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
        """``defaults`` less any key the constructor does not take.

        Some optimizers keep internal options in ``defaults`` (LAMB's ``layer_adaptation``,
        set by a LARS-style subclass). Dropping them is safe because every group passed to
        the constructor already carries the worker group's value of every option.
        """
        try:
            parameters = inspect.signature(self.optimizer_class.__init__).parameters
        except (TypeError, ValueError):
            return dict(self.defaults)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return dict(self.defaults)
        return {k: v for k, v in self.defaults.items() if k in parameters}

    def build(self, params: Mapping[int, Tensor] | Sequence[tuple[int, Tensor]]) -> Optimizer | None:
        """Build the optimizer over ``params``; ``None`` when empty.

        Args:
            params: flat index -> tensor, or (flat index, tensor) pairs in flat order (several
                slices of one tensor share its index and its param group's options).

        Groups keep the worker's group order; groups with no tensor on this shard are left out
        (torch optimizers reject empty groups), which :meth:`ParameterShard.load_state_dict`
        and :meth:`ParameterShard.state_dict` account for.
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


# Optimizers whose update is elementwise (see OptimizerSpec.elementwise): exact classes, since a
# subclass may change step()
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


def _group_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (every key but its per-tensor lists)."""
    return {k: v for k, v in group.items() if k not in _PER_TENSOR_KEYS}


def _group_starts(group_sizes: Sequence[int]) -> list[int]:
    """The flat index of the first tensor of every non-empty group."""
    starts, pos = [], 0
    for n in group_sizes:
        if n:
            starts.append(pos)
        pos += n
    return starts


def payload_bytes(tensors: Sequence[Tensor | None]) -> int:
    """Bytes of the tensors' data (``None`` counts nothing): what the byte counts measure."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def slice_of(tensor: Tensor, sl: Slice) -> Tensor:
    """The elements of ``sl`` in ``tensor`` (detached): the tensor itself when whole, else flat.

    A view when ``tensor`` is contiguous, else a copy.
    """
    t = tensor.detach()
    if sl.start == 0 and sl.stop == t.numel():
        return t
    return t.reshape(-1)[sl.start : sl.stop]


@dataclass
class Packed:
    """Tensors sent as one flat tensor per dtype: one payload per shard and step, not one per tensor.

    Attributes:
        flats: the tensors present, flattened and concatenated, one per dtype (dtypes in order
            of first appearance); always fresh memory, so a later update cannot change them.
        present: which of the tensors were sent (``None``: all); a tensor unused in a step has
            no gradient.
    """

    flats: list[Tensor]
    present: list[bool] | None = None

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.flats)


def pack(tensors: Sequence[Tensor | None]) -> Packed:
    """``tensors`` as one :class:`Packed` payload (a copy); :func:`unpack` reverses it."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        if t is not None:
            by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    present = [t is not None for t in tensors]
    return Packed([torch.cat(ts) for ts in by_dtype.values()], None if all(present) else present)


def unpack(packed: Packed, like: Sequence[Tensor]) -> list[Tensor | None]:
    """The tensors of ``packed``, shaped like ``like`` (views into the payload; ``None`` where absent).

    Raises:
        ValueError: when the payload does not fit ``like`` (count, dtypes or sizes).
    """
    present = packed.present if packed.present is not None else [True] * len(like)
    if len(present) != len(like):
        raise ValueError(f"a payload of {len(present)} tensors, expected {len(like)}")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(like):
        if present[k]:
            by_dtype.setdefault(t.dtype, []).append(k)
    if len(by_dtype) != len(packed.flats) or any(
        f.dtype != d or f.numel() != sum(like[k].numel() for k in ks)
        for f, (d, ks) in zip(packed.flats, by_dtype.items(), strict=False)
    ):
        raise ValueError(
            f"a payload of {[(f.dtype, f.numel()) for f in packed.flats]} (dtype, elements), expected "
            f"{[(d, sum(like[k].numel() for k in ks)) for d, ks in by_dtype.items()]}"
        )
    out: list[Tensor | None] = [None] * len(like)
    for flat, ks in zip(packed.flats, by_dtype.values(), strict=True):
        offset = 0
        for k in ks:
            n = like[k].numel()
            out[k] = flat[offset : offset + n].view(like[k].shape)
            offset += n
    return out


# --------------------------------------------------------------------------------------------
# The shard (server side)
# --------------------------------------------------------------------------------------------


@dataclass
class ShardReply:
    """A shard's answer to one push.

    Attributes:
        values: the shard's tensors after the step, in the shard's order, packed (one flat
            tensor per dtype; the same payload for every worker).
        version: optimizer steps the shard has taken (the workers' step count).
        step_bytes: payload bytes the shard received plus sent for this step (all workers), so
            every worker can log the busiest shard without an extra collective.
    """

    values: Packed
    version: int
    step_bytes: int


@dataclass
class _PendingStep:
    grads: dict[int, list[Tensor | None]] = field(default_factory=dict)
    futures: dict[int, Future[ShardReply | ShardError]] = field(default_factory=dict)
    lrs: list[float] | None = None
    bytes_in: int = 0
    deadline: float | None = None  # time.monotonic() by which the last push must arrive


class ParameterShard:
    """One server shard: a range of the model's flattened parameters and the optimizer over it.

    The shard holds :class:`Slice` s: whole tensors (kept in their shapes) or parts of tensors
    (held flat), each optimized as a parameter of its own, in the param group of its tensor.

    Pushes arrive on RPC threads (and on the co-located worker's training thread), so all
    state is guarded by one lock; the optimizer step runs on the thread of the push that
    completes the step, and the futures of the waiting workers are completed outside the lock
    (their callbacks serialise the reply inline). No thread is started per step: one watchdog
    thread per shard (started at the first barrier, ended by :meth:`close`) fails a step still
    open at its deadline.

    Args:
        shard_id: index of this shard (the rank that hosts it).
        slices: what it holds, in flat order: :class:`Slice` s, or optimizer-order indices of
            whole tensors.
        params: their initial values (copied; the shard owns its tensors): for a slice, its
            elements in any shape (:func:`slice_of`).
        spec: how to rebuild the worker's optimizer over them.
        num_workers: workers that push every step (the barrier's width).
        timeout: how long the barrier waits for the last worker of a step before failing every
            waiting worker with an error that names the missing ones.
        streams: the stream operations of :class:`~lightning_strategies.comm.streams.StreamOrder`
            (default: CUDA streams for tensors on a GPU, none on CPU; tests pass a fake).
    """

    def __init__(
        self,
        shard_id: int,
        slices: Sequence[Slice | int],
        params: Sequence[Tensor],
        spec: OptimizerSpec,
        num_workers: int,
        *,
        timeout: timedelta = timedelta(minutes=30),
        streams: StreamBackend | None = None,
    ) -> None:
        if len(slices) != len(params):
            raise ValueError(f"{len(slices)} slices for {len(params)} tensors")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, found {num_workers}")
        self.slices = [_as_slice(sl, p.numel()) for sl, p in zip(slices, params, strict=True)]
        if any(sl.numel != p.numel() for sl, p in zip(self.slices, params, strict=True)):
            raise ValueError(
                f"slice sizes {[sl.numel for sl in self.slices]} != tensor sizes {[p.numel() for p in params]}"
            )
        self.shard_id = shard_id
        self.flat_indices = [sl.tensor for sl in self.slices]
        self.params = [p.detach().clone().requires_grad_(True) for p in params]
        # the shard's device work runs on a stream of its own, after the clones above (see .streams)
        self._order = StreamOrder.for_tensors(self.params, streams)
        self._order.take(self.params)
        self.spec = spec
        self.num_workers = num_workers
        self.timeout = timeout
        self.optimizer = spec.build(list(zip(self.flat_indices, self.params, strict=True)))
        self._groups = [spec.group_of(i) for i in self.flat_indices]
        # which of the worker's groups each of this optimizer's groups is (empty ones are skipped)
        self._group_ids = sorted(set(self._groups))
        self._values_bytes = payload_bytes(self.params)
        self.stats = CommStats()
        self.version = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # wakes the watchdog for a new deadline
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._pending = _PendingStep()
        self._failure: str | None = None

    # -- pushes -------------------------------------------------------------------------------

    def push(
        self, worker: int, step: int, grads: list[Tensor | None], lrs: list[float]
    ) -> Future[ShardReply | ShardError]:
        """Take worker ``worker``'s gradients for step ``step``; the future holds the new values.

        Args:
            worker: the pushing worker's index in ``[0, num_workers)``.
            step: the worker's step count; every worker must push the shard's current step
                exactly once.
            grads: one gradient (or ``None`` for an unused tensor) per slice of this shard.
            lrs: the worker's current learning rate of every param group of its optimizer.
        """
        # completed later, maybe on another thread: a stream-aware future set on the shard stream
        fut: Future[ShardReply | ShardError] = self._order.future()
        nbytes = payload_bytes(grads)
        with self._lock:
            self.stats.bytes_received += nbytes
            self.stats.calls += 1
            error = self._check_push(worker, grads, lrs) or self._check_step(worker, step)
            if error is not None:
                fut.set_result(ShardError(error))
                return fut
            # the gradients were made (or received) on this thread's stream: the step waits for them
            self._order.take(grads)
            pending = self._pending
            pending.grads[worker] = grads
            pending.futures[worker] = fut
            pending.lrs = lrs
            pending.bytes_in += nbytes
            if len(pending.grads) == 1 and self.num_workers > 1:
                pending.deadline = time.monotonic() + self.timeout.total_seconds()
                self._start_watchdog()
                self._cond.notify()
            if len(pending.grads) < self.num_workers:
                return fut
            self._pending = _PendingStep()  # the watchdog finds no deadline: nothing to fail
            sent = self.num_workers * self._values_bytes
            self.stats.bytes_sent += sent
            with self._order.running():
                self._step([pending.grads[w] for w in range(self.num_workers)], pending.lrs)
                # a snapshot, one for every worker: packing copies once per step, not once per worker,
                # and no later step can change a reply still being read or sent
                reply = ShardReply(pack(self.params), self.version, pending.bytes_in + sent)
        self._order.complete([pending.futures[w] for w in sorted(pending.futures)], reply)
        return fut

    def _check_push(self, worker: int, grads: list[Tensor | None], lrs: list[float]) -> str | None:
        """What is wrong with a push, whatever its step (``None``: nothing)."""
        where = f"parameter server shard {self.shard_id}"
        if self._failure is not None:
            return f"{where} has failed earlier and takes no more pushes: {self._failure}"
        if not 0 <= worker < self.num_workers:
            return f"{where}: push from worker {worker}, expected a worker in [0, {self.num_workers})"
        if len(grads) != len(self.params):
            return f"{where}: worker {worker} pushed {len(grads)} gradients, expected {len(self.params)}"
        if len(lrs) != len(self.spec.group_sizes):
            return (
                f"{where}: worker {worker} sent {len(lrs)} learning rates, expected one per param group "
                f"({len(self.spec.group_sizes)})"
            )
        return None

    def _check_step(self, worker: int, step: int) -> str | None:
        """What is wrong with the step of a push to the barrier (``None``: nothing)."""
        where = f"parameter server shard {self.shard_id}"
        if step != self.version:
            return (
                f"{where}: worker {worker} pushed step {step} while the shard is at step {self.version}; "
                "every worker must push every step once (did a worker skip an "
                "optimizer step, e.g. a training_step returning None on one rank only?)"
            )
        if worker in self._pending.grads:
            return f"{where}: worker {worker} pushed step {step} twice"
        return None

    # -- the barrier's timeout ----------------------------------------------------------------

    def _start_watchdog(self) -> None:
        """Start the shard's one watchdog thread, at its first barrier (called under the lock).

        One thread for the shard's life instead of a timer per step: it sleeps until the open
        step's deadline, and a step that completes first just leaves it nothing to do.
        """
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name=f"ps-shard-{self.shard_id}-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    deadline = self._pending.deadline
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        break
                    self._cond.wait(None if deadline is None else deadline - now)
                pending = self._expire()
            # the remote workers' errors first: once the co-located worker (index == shard_id)
            # wakes up it fails and shuts RPC down, which would drop replies not yet on the wire
            assert self._failure is not None
            for w in sorted(pending.futures, key=lambda w: (w == self.shard_id, w)):
                pending.futures[w].set_result(ShardError(self._failure, timed_out=True))

    def _expire(self) -> _PendingStep:
        """Fail the open step (under the lock), naming the workers that never pushed; its
        futures are completed by the caller, outside the lock."""
        pending = self._pending
        missing = [w for w in range(self.num_workers) if w not in pending.grads]
        self._failure = (
            f"parameter server shard {self.shard_id} waited {self.timeout.total_seconds():.0f}s for "
            f"the gradients of step {self.version} from worker(s) {missing} (received from "
            f"{sorted(pending.grads)}). Worker(s) {missing} died or are stuck; check their logs. "
            "To wait longer for slow workers, raise the strategy's `timeout`."
        )
        self._pending = _PendingStep()
        return pending

    def close(self, reason: str | None = None) -> str | None:
        """Stop the watchdog thread: the shard is being dropped.

        Args:
            reason: why, when the host failed (the failure's first line). The workers waiting
                in the open step's barrier are then answered at once with an error that carries
                it, so a survivor names the peer whose loss started the failure instead of
                waiting for the barrier's timeout or the host's connection to drop. Without a
                reason (a clean teardown) pending pushes stay pending.

        Returns:
            The error later pushes to this shard's id should get (``None`` without a reason).
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if reason is None:
                return None
            if self._failure is None:
                self._failure = f"parameter server shard {self.shard_id} stopped because its host failed: {reason}"
            pending, self._pending = self._pending, _PendingStep()
            failure = self._failure
        for w in sorted(pending.futures):
            pending.futures[w].set_result(ShardError(failure))
        return failure

    # -- optimizer ----------------------------------------------------------------------------

    def _set_lrs(self, lrs: Sequence[float]) -> None:
        if self.optimizer is None:
            return
        for group, g in zip(self.optimizer.param_groups, self._group_ids, strict=True):
            group["lr"] = lrs[g]

    def _step(self, grads_by_worker: list[list[Tensor | None]], lrs: Sequence[float] | None) -> None:
        if self.optimizer is None:
            self.version += 1
            return
        n = len(grads_by_worker)
        for i, p in enumerate(self.params):
            avg: Tensor | None = None
            for grads in grads_by_worker:
                g = grads[i]
                if g is None:
                    continue
                # divide then sum in worker order: DDP's reducer divides each rank's gradient by
                # the world size before the sum-all-reduce, so the rounding matches for P=2
                part = g.to(p.device, p.dtype).div(n) if n > 1 else g.to(p.device, p.dtype)
                avg = part if avg is None else avg.add_(part)
            p.grad = avg
        if lrs is not None:
            self._set_lrs(lrs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    # -- state ---------------------------------------------------------------------------------

    def values(self) -> list[Tensor]:
        """Copies of the shard's current tensors, ordered for the caller's stream."""
        with self._lock:
            with self._order.running():
                copies = [p.detach().clone() for p in self.params]
            self._order.give(copies)
        return copies

    def unpack(self, packed: Packed) -> list[Tensor | None]:
        """A pushed payload as one gradient (or ``None``) per slice."""
        return unpack(packed, self.params)

    def state_dict(self) -> dict[str, Any]:
        """This shard's optimizer state keyed by :class:`Slice`.

        Returns:
            ``{"state": {slice: its state}, "param_groups": {group: options}}``;
            :meth:`ParameterServerClient.gather_state_dict` joins the slices of every tensor
            into one state dict shaped like ``worker_optimizer.state_dict()``.
        """
        with self._lock:
            if self.optimizer is None:
                return {"state": {}, "param_groups": {}, "version": self.version}
            with self._order.running():
                sd = self.optimizer.state_dict()
                # copies, like the replies: the caller reads (or an RPC sends) them after the lock
                state = {self.slices[i]: _copy_state(st) for i, st in sd["state"].items()}
            self._order.give(v for st in state.values() for v in st.values() if isinstance(v, Tensor))
            return {
                "state": state,
                "param_groups": {
                    g: _group_options(group) for g, group in zip(self._group_ids, sd["param_groups"], strict=True)
                },
                "version": self.version,
            }

    def load_state_dict(self, full_state: Mapping[str, Any], version: int | None = None) -> None:
        """Load this shard's part of a full optimizer state dict (worker optimizer format).

        Args:
            full_state: ``{"state": {flat_index: ...}, "param_groups": [...]}`` as returned by
                :meth:`ParameterServerClient.gather_state_dict` (or a plain optimizer's
                ``state_dict()`` of the same model).
            version: the step count to resume at (the barrier needs the workers' step).

        A slice of a tensor takes its elements of the tensor's per-element state (a state
        tensor larger than the slice); scalars such as a step count are shared.
        """
        with self._lock:
            if version is not None:
                self.version = version
            if self.optimizer is None:
                return
            groups = []
            for g in self._group_ids:
                options = _group_options(full_state["param_groups"][g])
                groups.append({**options, "params": [k for k, gk in enumerate(self._groups) if gk == g]})
            by_tensor = {int(f): s for f, s in full_state["state"].items()}
            self._order.take(v for st in by_tensor.values() for v in st.values() if isinstance(v, Tensor))
            with self._order.running():
                state = {
                    k: _slice_state(by_tensor[sl.tensor], sl, p)
                    for k, (sl, p) in enumerate(zip(self.slices, self.params, strict=True))
                    if sl.tensor in by_tensor
                }
                self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def load_values(self, values: Sequence[Tensor]) -> None:
        """Overwrite the shard's tensors (e.g. with the weights of a restored checkpoint)."""
        with self._lock, torch.no_grad():
            self._order.take(values)
            with self._order.running():
                for p, v in zip(self.params, values, strict=True):
                    p.copy_(v.reshape(p.shape))


def _as_slice(item: Slice | int, numel: int) -> Slice:
    """A :class:`Slice`; a bare tensor index means the whole tensor of ``numel`` elements."""
    return item if isinstance(item, Slice) else Slice(int(item), 0, numel)


def _copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied."""
    return {key: v.clone() if isinstance(v, Tensor) else v for key, v in state.items()}


def _slice_state(state: Mapping[str, Any], sl: Slice, param: Tensor) -> dict[str, Any]:
    """A slice's part of its tensor's optimizer state.

    Per-element state is a tensor with more elements than the slice (the whole tensor's); a
    whole tensor's state, and scalars such as a step count, are taken as they are. Tensors are
    copied: ``Optimizer.load_state_dict`` keeps a ``step`` tensor as given, and the slices of a
    tensor sharing one would each increment it.
    """
    return {
        key: (
            v.reshape(-1)[sl.start : sl.stop].clone().view(param.shape)
            if v.dim() >= 1 and v.numel() > param.numel()
            else v.clone()
        )
        if isinstance(v, Tensor)
        else v
        for key, v in state.items()
    }


def _join_state(pieces: Sequence[tuple[Slice, Mapping[str, Any]]], param: Tensor) -> dict[str, Any]:
    """One tensor's optimizer state from its slices' states (in element order).

    The per-element state of the slices (flat tensors of the slice's size) is concatenated and
    shaped like ``param``; scalars (a step count) are equal in every slice and taken once.
    """
    if len(pieces) == 1 and pieces[0][0].numel == param.numel():
        return dict(pieces[0][1])
    covered = sum(sl.numel for sl, _ in pieces)
    if covered != param.numel():
        raise RuntimeError(
            f"the optimizer state of tensor {pieces[0][0].tensor} covers {covered} of its {param.numel()} "
            "elements: a shard is missing from the gathered state"
        )
    joined: dict[str, Any] = {}
    for key, first in pieces[0][1].items():
        per_element = isinstance(first, Tensor) and first.dim() >= 1
        if per_element:
            joined[key] = torch.cat([st[key].reshape(-1) for _, st in pieces]).view(param.shape)
        else:
            joined[key] = first
    return joined


# --------------------------------------------------------------------------------------------
# RPC entry points (the shard is found in :mod:`.rpc`'s registry)
# --------------------------------------------------------------------------------------------


@rpc.functions.async_execution
def _rpc_push(
    shard_id: int, worker: int, step: int, grads: Packed, lrs: list[float]
) -> Future[ShardReply | ShardError]:
    # returns the barrier's future at once: the RPC thread is free while the step waits
    shard = hosted_shard(shard_id)
    try:
        unpacked = shard.unpack(grads)
    except ValueError as err:
        return completed(ShardError(f"parameter server shard {shard_id}: worker {worker} pushed {err}"))
    return shard.push(worker, step, unpacked, lrs)


def _rpc_state_dict(shard_id: int) -> dict[str, Any]:
    return hosted_shard(shard_id).state_dict()


# --------------------------------------------------------------------------------------------
# The worker side
# --------------------------------------------------------------------------------------------


class ParameterServerClient:
    """A worker's handle on every shard: push gradients, pull values, count bytes.

    Args:
        worker: this worker's index (its global rank).
        params: the worker's trainable tensors in the optimizer's flat order; the pulled
            values are copied into them in place.
        plan: per shard, its :class:`Slice` s (:func:`partition_parameters`) or the indices of
            its whole tensors (:func:`shard_parameters`); shard ``s`` is hosted by rank ``s``.
        timeout: the barrier timeout of the shards; the RPC timeout is a little longer so the
            shard's error, which names the missing workers, arrives first.
    """

    def __init__(
        self,
        worker: int,
        params: Sequence[Tensor],
        plan: Sequence[Sequence[Slice | int]],
        *,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        self.worker = worker
        self.params = list(params)
        self.plan = [[x if isinstance(x, Slice) else _as_slice(x, self.params[x].numel()) for x in p] for p in plan]
        self.rpc_timeout = timeout.total_seconds() + max(5.0, 0.1 * timeout.total_seconds())
        self.stats = CommStats()
        self.step = 0
        self.last_wait_seconds = 0.0
        self.last_server_bytes = [0] * len(self.plan)

    @property
    def num_servers(self) -> int:
        return len(self.plan)

    def push_pull(self, lrs: Sequence[float]) -> None:
        """Push ``p.grad`` of every tensor to its shard, wait for all shards, copy the answers.

        One message per shard each way: the gradients of the shard's slices packed into one
        flat tensor (per dtype), and its values likewise. All shards are contacted before
        waiting on any (``rpc_async``), so the shards work in parallel; the co-located shard is
        called directly. This is the worker's only synchronisation point of the step.

        Raises:
            RuntimeError: naming the shard and its host rank when a shard fails or times out.
        """
        start = time.perf_counter()
        grads = [p.grad for p in self.params]
        replies = self._call_shards(
            _rpc_push, lambda idx: (self.worker, self.step, self._outgoing(grads, idx), list(lrs))
        )
        for s, reply in replies.items():
            self._apply_reply(s, reply)
        self._end_step(start)

    def _call_shards(
        self, entry: Callable[..., Any], args_for: Callable[[list[Slice]], tuple[Any, ...]]
    ) -> dict[int, Any]:
        """``entry(s, *args_for(plan[s]))`` for every shard ``s`` holding tensors, all in flight at
        once; their replies (a failure raises, naming its shard)."""
        futures = {
            s: call_host(s, entry, s, *args_for(idx), local=local_shard(s) is not None, timeout=self.rpc_timeout)
            for s, idx in enumerate(self.plan)
            if idx  # more shards than tensors: nothing to exchange with an empty one
        }
        self.stats.calls += len(futures)
        return self._wait_all(futures)

    def _outgoing(self, grads: Sequence[Tensor | None], slices: Sequence[Slice]) -> Packed:
        """The gradients of ``slices`` packed into one payload, counted as sent."""
        packed = pack([slice_of(g, sl) if (g := grads[sl.tensor]) is not None else None for sl in slices])
        self.stats.bytes_sent += packed.nbytes
        return packed

    def _apply_reply(self, s: int, reply: Any) -> None:
        """Copy shard ``s``'s values (if the reply has any) into the local tensors."""
        self.last_server_bytes[s] = reply.step_bytes
        if reply.values is None:
            return
        slices = self.plan[s]
        values = unpack(reply.values, [slice_of(self.params[sl.tensor], sl) for sl in slices])
        with torch.no_grad():
            for sl, v in zip(slices, values, strict=True):
                if v is not None:  # values are always whole payloads: never None
                    _write_slice(self.params[sl.tensor], sl, v)
        self.stats.bytes_received += reply.values.nbytes

    def _end_step(self, start: float) -> None:
        self.step += 1
        self.last_wait_seconds = time.perf_counter() - start
        self.stats.seconds += self.last_wait_seconds

    def _wait_all(self, futures: Mapping[int, Future[Any]]) -> dict[int, Any]:
        """Each shard's result (shard id -> future), or the first failure as soon as it happens.

        Waiting in shard order would report a dead host only after an earlier shard's barrier
        timed out; a gate future opened by the first failure (or by the last success) reports
        the dead one at once.
        """
        if not futures:
            return {}
        gate: Future[int] = Future()
        lock = threading.Lock()
        pending = [len(futures)]

        def on_done(s: int, fut: Future[Any]) -> None:
            failed = fut.done() and is_failure(fut)
            with lock:
                pending[0] -= 1
                if gate.done():
                    return
                if failed:
                    gate.set_result(s)
                elif pending[0] == 0:
                    gate.set_result(-1)

        for s, fut in futures.items():
            fut.add_done_callback(functools.partial(on_done, s))
        first_failed = gate.wait()
        if first_failed >= 0:
            self._wait(first_failed, futures[first_failed])  # raises, naming the shard
        return {s: self._wait(s, fut) for s, fut in futures.items()}

    def _wait(self, s: int, fut: Future[Any]) -> Any:
        where = (
            f"worker {self.worker}: parameter server shard {s} (hosted by rank {s}, RPC name "
            f"{worker_name(s)!r}) failed at step {self.step}"
        )
        return wait_reply(fut, where)

    def gather_state_dict(
        self, spec: OptimizerSpec, worker_param_groups: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """Collect every shard's optimizer state into one ``Optimizer.state_dict()``-shaped dict.

        The result indexes tensors by the worker optimizer's flat order, so it loads into the
        same optimizer class over the same model on a single device, and back into the shards
        with :meth:`ParameterShard.load_state_dict`. Group options come from a shard holding a
        tensor of the group (they carry what the optimizer stores in its groups), else from the
        worker's optimizer.
        """
        futures = {
            s: call_host(s, _rpc_state_dict, s, local=local_shard(s) is not None, timeout=self.rpc_timeout)
            for s in range(self.num_servers)
        }
        pieces: dict[int, list[tuple[Slice, Any]]] = {}
        group_options: dict[int, dict[str, Any]] = {}
        for part in self._wait_all(futures).values():
            for sl, st in part["state"].items():
                pieces.setdefault(sl.tensor, []).append((sl, st))
            for g, options in part["param_groups"].items():
                group_options.setdefault(int(g), options)
        state = {i: _join_state(sorted(p, key=lambda x: x[0].start), self.params[i]) for i, p in pieces.items()}
        groups = []
        start = 0
        for g, n in enumerate(spec.group_sizes):
            worker_group = worker_param_groups[g]
            options = group_options.get(g, _group_options(worker_group))
            if "param_names" in worker_group:
                options = {**options, "param_names": list(worker_group["param_names"])}
            groups.append({**options, "params": list(range(start, start + n))})
            start += n
        return {"state": dict(sorted(state.items())), "param_groups": groups}


def _write_slice(param: Tensor, sl: Slice, value: Tensor) -> None:
    """``param``'s elements of ``sl`` = ``value`` (in place, under ``no_grad``)."""
    t = param.detach()
    if sl.start == 0 and sl.stop == t.numel():
        t.copy_(value.view(t.shape))
    elif t.is_contiguous():
        t.view(-1)[sl.start : sl.stop].copy_(value)
    else:  # e.g. channels_last: no flat view; write through a flat copy
        flat = t.reshape(-1).clone()
        flat[sl.start : sl.stop] = value
        t.copy_(flat.view(t.shape))


def broadcast_from_rank0(tensors: Sequence[Tensor]) -> None:
    """Rank 0's values of ``tensors`` everywhere, one broadcast per dtype (flattened).

    A collective of the default process group: every rank calls it with the same tensors. The
    workers keep non-trainable buffers (BatchNorm statistics) in step this way; the servers hold
    only what the optimizer updates.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                t.copy_(synced)
