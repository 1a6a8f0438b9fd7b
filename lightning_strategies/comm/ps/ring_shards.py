"""Synchronous parameter shards on the ring's two halves (no Lightning import).

``"ps"`` keeps shard ``s`` (``1/P`` of the flat trainable parameters) on rank ``s`` and moves pushes and
pulls over TensorPipe RPC. Where every rank hosts a shard, those are exactly the chunks a ring reduce-scatter
leaves on each rank: so here a worker's push is comm.ring's reduce-scatter (averaging) of a gradient bucket,
the co-located shard steps the user's optimizer on its chunk of the bucket, and the pull is comm.ring's
all-gather of the new values (:mod:`lightning_strategies.comm.ring.halves`). The same bytes cross each link
as under DDP's all-reduce, and each rank's optimizer steps ``1/P`` of the parameters.

As DDP's reducer, the trainable tensors are grouped into buckets in reverse of the optimizer's order, the
first one small, and a bucket goes as soon as backward has produced its last gradient (:meth:`RingShards.
grad_ready`): its gradients are copied into the bucket's flat buffer on the caller's thread, and a thread of
this object's own runs the bucket's reduce-scatter, step and all-gather on a process group of its own, while
backward goes on. :meth:`RingShards.flush` (the optimizer step) sends what is left, waits for every bucket and
writes the new values into the parameters. Clipping by norm needs every bucket's averaged gradient first: the
buckets' steps then wait for the agreed norm (one float per rank and step).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_strategies.comm.ps.buckets import DEFAULT_FIRST_BUCKET_MB, bucket_caps, bucket_groups
from lightning_strategies.comm.ps.clip import ClipSpec
from lightning_strategies.comm.ps.spec import OptimizerSpec, hyperparameters
from lightning_strategies.comm.ring.halves import owned_chunk, ring_all_gather, ring_reduce_scatter
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.comm.streams import StreamBackend, StreamOrder

__all__ = ["RingBucket", "RingShards", "RingStepTimes"]


@dataclass
class RingBucket:
    """One bucket: its tensors laid out in flat buffers, and this rank's shard of it.

    Attributes:
        tensors: flat indices (the optimizer's order) of its tensors, in buffer order.
        offsets: where each tensor starts in the buffers.
        grad: the gradients, reduced into the owned chunk by the push.
        values: the parameters' values, the owned chunk stepped, then all-gathered.
        owned: this rank's chunk ``[start, end)`` of the buffers.
        pieces: per tensor holding part of the owned chunk: (flat index, start, end, the tensor's offset), in
            the buffers, in the optimizer's order.
        optimizer: the user's optimizer over the pieces (views of ``values``); ``None`` when nothing is owned.
    """

    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    grad: Tensor
    values: Tensor
    owned: tuple[int, int]
    pieces: list[tuple[int, int, int, int]]
    piece_params: list[torch.nn.Parameter]
    optimizer: Optimizer | None
    group_of_piece_group: list[int] = field(default_factory=list)  # the spec's group of each optimizer group


@dataclass
class RingStepTimes:
    """One step's moments, in ``time.perf_counter()`` seconds: the first bucket queued, the backward's end
    (:meth:`RingShards.flush` called) and every value written; ``wait_seconds``, what :meth:`RingShards.flush`
    waited for the buckets. ``bytes_before_backward_end`` of ``bytes_pushed``: the gradient bytes of the buckets
    queued before backward ended."""

    first_push: float | None = None
    backward_end: float | None = None
    landed: float | None = None
    wait_seconds: float = 0.0
    bytes_pushed: int = 0
    bytes_before_backward_end: int = 0

    @property
    def overlap_share(self) -> float:
        """Share of the step's push bytes queued before backward ended."""
        return self.bytes_before_backward_end / self.bytes_pushed if self.bytes_pushed else 0.0


class RingShards:
    """This rank's shard of every bucket, and the push (reduce-scatter), step and pull (all-gather) of each.

    Args:
        params: the optimizer's tensors in its order (one floating dtype and device); frozen ones are left out.
        spec: the user's optimizer (:class:`OptimizerSpec`), rebuilt over each bucket's owned pieces: it must be
            :attr:`~OptimizerSpec.elementwise`, since a chunk cuts tensors anywhere.
        group: a process group of every rank, used only by this object (its thread, and between steps
            :mod:`.ring_shard_state`); with ``inter_group``, this process's node.
        inter_group: the hierarchical push (:func:`~lightning_strategies.comm.ring.new_hierarchical_groups`'
            inter-node group): reduce-scatter in the node, then across nodes on the ``1/L`` this process holds,
            the step on ``1/(N L)``, then all-gather across nodes and in the node. A node's NIC then carries
            ``2 (N-1)/N`` of the gradient per step, as the hierarchical ring's.
        bucket_cap_mb: a bucket's size (DDP's ``bucket_cap_mb``); the first is ``min(1, bucket_cap_mb)`` MiB.
        clip: what to clip the averaged gradient by (Lightning's ``gradient_clip_val`` / ``_algorithm``).
        timeout: seconds :meth:`flush` waits for the thread at most (a lost peer fails the ring sooner, within
            the group's timeout; this bounds the wait should the thread itself hang).

    Raises:
        ValueError: for tensors of several dtypes or devices, a non-floating dtype, or a non-elementwise optimizer.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        spec: OptimizerSpec,
        group: dist.ProcessGroup,
        *,
        bucket_cap_mb: float = 25.0,
        clip: ClipSpec | None = None,
        timeout: float = 1800.0,
        inter_group: dist.ProcessGroup | None = None,
        streams: StreamBackend | None = None,
    ) -> None:
        _check_params(params, spec)
        self.params = list(params)
        self.spec = spec
        self.group = group
        self.inter_group = inter_group
        self.clip = clip if clip is not None and clip.clips else None
        # by norm the buckets' steps wait for the agreed norm: a push per bucket, then one step-and-pull of all
        self._clips_norm = self.clip is not None and self.clip.algorithm == "norm"
        self.timeout = timeout
        self.rank = dist.get_rank()  # for messages: the job's rank
        self.local, self.local_size = dist.get_rank(group), dist.get_world_size(group)
        self.node, self.nodes = (
            (dist.get_rank(inter_group), dist.get_world_size(inter_group)) if inter_group else (0, 1)
        )
        #: Processes every gradient is averaged over.
        self.world = self.local_size * self.nodes
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        nbytes = [self.params[i].numel() * self.params[i].element_size() for i in trainable]
        caps = bucket_caps(bucket_cap_mb, min(DEFAULT_FIRST_BUCKET_MB, bucket_cap_mb))
        self.buckets = [self._bucket([trainable[k] for k in g]) for g in bucket_groups(nbytes, **caps)]
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.tensors}
        #: Off while accumulating micro-batches: gradients are neither pushed nor checked (DDP's ``no_sync``).
        self.enabled = True
        self.stats = CommStats()
        self.last = RingStepTimes()
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._queued = [False] * len(self.buckets)
        self._next = 0  # the next bucket to queue
        self._options: list[dict[str, Any]] | None = None  # the worker's group options for this step
        self._step = RingStepTimes()
        self._done = threading.Semaphore(0)
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        #: On CUDA the thread works on a stream of its own, after the caller's (events, no host wait).
        self.order = StreamOrder.for_tensors([b.grad for b in self.buckets], streams)
        self._thread = threading.Thread(target=self._serve, name="ps-ring-shards", daemon=True)
        self._thread.start()

    # -- layout ---------------------------------------------------------------------------------

    def _bucket(self, tensors: list[int]) -> RingBucket:
        sizes = [self.params[i].numel() for i in tensors]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        total = sum(sizes)
        like = self.params[tensors[0]]
        grad = torch.zeros(total, dtype=like.dtype, device=like.device)
        values = torch.zeros_like(grad)
        a, b = owned_chunk(total, self.local_size, self.local)  # in the node (flat: in the job)
        c, d = owned_chunk(b - a, self.nodes, self.node)  # across nodes, of that (flat: all of it)
        start, end = a + c, a + d
        pieces = [
            (i, max(start, off), min(end, off + n), off)
            for i, off, n in zip(tensors, offsets, sizes, strict=True)
            if max(start, off) < min(end, off + n)
        ]
        pieces.sort()  # the optimizer's order, as its groups expect
        piece_params = [torch.nn.Parameter(values[a:b]) for _, a, b, _ in pieces]
        optimizer = self.spec.build([(piece[0], p) for piece, p in zip(pieces, piece_params, strict=True)])
        groups = sorted({self.spec.group_of(piece[0]) for piece in pieces})
        return RingBucket(
            tuple(tensors), tuple(offsets), grad, values, (start, end), pieces, piece_params, optimizer, groups
        )

    # -- backward: queue buckets as they fill -----------------------------------------------------

    def attach(self) -> list[RemovableHandle]:
        """Register :meth:`grad_ready` as every trainable tensor's post-accumulate-grad hook; the handles."""
        return [
            self.params[i].register_post_accumulate_grad_hook(functools.partial(self._hook, i))
            for b in self.buckets
            for i in b.tensors
        ]

    def _hook(self, index: int, _param: Tensor) -> None:
        self.grad_ready(index)

    def begin_step(self, options: Sequence[Mapping[str, Any]]) -> None:
        """The worker optimizer's param groups for the coming step (learning rates and every other option a
        scheduler may change); read by the first bucket queued. Call it before the step's backward."""
        self._options = [hyperparameters(g) for g in options]

    def grad_ready(self, index: int) -> None:
        """Tensor ``index``'s gradient of this backward is accumulated: queue its bucket once full.

        Raises:
            RuntimeError: when its gradient comes twice in one step (two backward calls per optimizer step).
        """
        if not self.enabled:
            return
        b = self._bucket_of[index]
        if self._queued[b] or index in self._ready[b]:
            raise RuntimeError(
                f"ps_ring rank {self.rank}: the gradient of trainable tensor {index} (optimizer order) was "
                "accumulated twice in one step, after its bucket was pushed. Expected one backward per optimizer "
                "step. Fix: call backward once per step (Lightning's accumulate_grad_batches holds the pushes), or "
                "pass overlap=False."
            )
        self._ready[b].add(index)
        # in bucket order, as DDP's reducer: every rank must meet in the same ring call, whatever order its
        # backward completes the buckets in
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next].tensors):
            self._queue(self._next)

    def _queue(self, b: int) -> None:
        bucket = self.buckets[b]
        missing = [i for i in bucket.tensors if self.params[i].grad is None]
        if missing:
            raise RuntimeError(
                f"ps_ring rank {self.rank}: trainable tensor(s) {sorted(missing)} (optimizer order) have no gradient "
                "at the optimizer step. Expected a gradient for every trainable tensor in every step, as DDP without "
                "find_unused_parameters (its shard steps every element). Fix: freeze them (requires_grad=False) or "
                "leave them out of the optimizer, or use strategy='ps'."
            )
        with torch.no_grad():
            for i, off in zip(bucket.tensors, bucket.offsets, strict=True):
                g = self.params[i].grad
                assert g is not None
                bucket.grad[off : off + g.numel()].copy_(g.reshape(-1))
        now = time.perf_counter()
        step = self._step
        if step.first_push is None:
            step.first_push = now
        pushed = bucket.grad.numel() * bucket.grad.element_size()
        step.bytes_pushed += pushed if self.world > 1 else 0
        if step.backward_end is None and self.world > 1:
            step.bytes_before_backward_end += pushed
        self._queued[b] = True
        self._next = b + 1
        self.order.take()  # the shards' stream after the copy (and the last step's values written), in bucket order
        if self._clips_norm:
            self._work.put(functools.partial(self._push, bucket))
        else:
            self._work.put(functools.partial(self._push_step_pull, bucket))

    # -- the optimizer step: what is left, then wait and land ------------------------------------------

    def flush(self) -> None:
        """Queue every bucket not queued yet, wait until every bucket's new values arrived and write them into
        the parameters (the wait: :attr:`last`'s ``wait_seconds``).

        Raises:
            RuntimeError: a bucket's exchange or step failed on the thread (its error, e.g. a
                :class:`~lightning_strategies.comm.ring.RingPeerError` naming the lost peer), or the thread did
                not finish within ``timeout``.
        """
        self._step.backward_end = time.perf_counter()
        if self._options is None:
            raise RuntimeError("RingShards.flush: begin_step(options) was not called for this step.")
        for b in range(self._next, len(self.buckets)):
            self._queue(b)
        if self._clips_norm:
            self._work.put(self._clip_step_pull)
        start = time.perf_counter()
        expected = len(self.buckets) + int(self._clips_norm)
        try:
            for _ in range(expected):
                if not self._done.acquire(timeout=self.timeout):
                    raise RuntimeError(
                        f"ps_ring rank {self.rank}: the shards' thread did not finish the step's buckets within "
                        f"{self.timeout:.0f} s (a peer hung past the process group's timeout?). Expected every "
                        "bucket's exchange to end or fail within it. Fix: check the peers' logs."
                    )
                if self._error is not None:
                    raise self._error
        finally:
            self._ready = [set() for _ in self.buckets]
            self._queued = [False] * len(self.buckets)
            self._next = 0
            self._options = None
        waited = time.perf_counter() - start
        self.order.give()  # the caller's stream after every bucket's exchange and step
        with torch.no_grad():
            for bucket in self.buckets:
                for i, off in zip(bucket.tensors, bucket.offsets, strict=True):
                    p = self.params[i]
                    p.copy_(bucket.values[off : off + p.numel()].view_as(p))
        self._step.landed = time.perf_counter()
        self._step.wait_seconds = waited
        self.last, self._step = self._step, RingStepTimes()

    # -- the thread -----------------------------------------------------------------------------

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            if self._error is None:
                try:
                    with self.order.running():
                        item()
                except BaseException as exc:  # handed to flush, which raises it on the training thread
                    self._error = exc
            self._done.release()

    def _push(self, bucket: RingBucket) -> None:
        if self.inter_group is None:
            ring_reduce_scatter(bucket.grad, self.group, average=True, stats=self.stats)
            return
        ring_reduce_scatter(bucket.grad, self.group, average=False, stats=self.stats)
        a, b = owned_chunk(bucket.grad.numel(), self.local_size, self.local)
        across = self._across()
        ring_reduce_scatter(bucket.grad[a:b], self.inter_group, divisor=self.world, stats=across)
        self._count_across(across)

    def all_gather(self, flat: Tensor) -> None:
        """Every rank's owned chunk of a bucket-shaped buffer, everywhere (the pull; a checkpoint's state): across
        nodes the chunk this node holds, then in the node."""
        if self.inter_group is not None:
            a, b = owned_chunk(flat.numel(), self.local_size, self.local)
            across = self._across()
            ring_all_gather(flat[a:b], self.inter_group, stats=across)
            self._count_across(across)
        ring_all_gather(flat, self.group, stats=self.stats)

    def _across(self) -> CommStats:
        return CommStats(inter_node_bytes_sent=0, inter_node_bytes_received=0)

    def _count_across(self, across: CommStats) -> None:
        across.inter_node_bytes_sent, across.inter_node_bytes_received = across.bytes_sent, across.bytes_received
        self.stats += across

    def _push_step_pull(self, bucket: RingBucket) -> None:
        self._push(bucket)
        self._step_pull(bucket, None)

    def _step_pull(self, bucket: RingBucket, factor: Tensor | None) -> None:
        a, b = bucket.owned
        grad = bucket.grad[a:b]
        if self.clip is not None and self.clip.algorithm == "value":
            assert self.clip.clip_val is not None
            grad.clamp_(-self.clip.clip_val, self.clip.clip_val)
        elif factor is not None:
            grad.mul_(factor.to(grad.dtype))
        self._step_owned(bucket)
        self.all_gather(bucket.values)

    def _step_owned(self, bucket: RingBucket) -> None:
        if bucket.optimizer is None:
            return
        assert self._options is not None
        with torch.no_grad():
            for (i, a, b, off), p in zip(bucket.pieces, bucket.piece_params, strict=True):
                # the current values (the worker's copy: written at the last flush, or loaded since)
                p.copy_(self.params[i].detach().reshape(-1)[a - off : b - off])
                p.grad = bucket.grad[a:b]
        for group, g in zip(bucket.optimizer.param_groups, bucket.group_of_piece_group, strict=True):
            group.update(self._options[g])
        bucket.optimizer.step()
        for p in bucket.piece_params:
            p.grad = None

    def _clip_step_pull(self) -> None:
        """Clipping by norm, once every bucket's gradient is averaged: agree on the global norm, scale, step, pull.
        As ``torch.nn.utils.clip_grad_norm_``: ``g * min(1, c / (norm + 1e-6))``."""
        assert self.clip is not None and self.clip.clip_val is not None
        parts = [b.grad[b.owned[0] : b.owned[1]] for b in self.buckets]
        sq = torch.zeros(1, dtype=torch.float64, device=self.buckets[0].grad.device)
        for part in parts:
            if part.numel():
                sq += torch.linalg.vector_norm(part, dtype=torch.float64).square()
        for group in (self.group, self.inter_group):
            if group is not None:
                dist.all_reduce(sq, group=group)
        # a device tensor, never read on the host: min(1, c / (norm + 1e-6)) in float64, rounded once
        factor = (self.clip.clip_val / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for bucket in self.buckets:
            self._step_pull(bucket, factor)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once queued work is done; whether it stopped within ``timeout`` (a thread blocked in
        a ring call to a hung peer is left behind as a daemon: do not destroy its group then)."""
        if self._thread.is_alive():
            self._work.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout)
        return not self._thread.is_alive()


def _check_params(params: Sequence[Tensor], spec: OptimizerSpec) -> None:
    kinds = sorted({(str(p.dtype), str(p.device)) for p in params if p.requires_grad})
    if len(kinds) > 1:
        raise ValueError(
            f"ps_ring found trainable tensors of {len(kinds)} dtypes or devices {kinds}: expected one floating "
            "dtype on one device, since each bucket is one flat buffer. Fix: cast the model to one dtype (mixed "
            "precision keeps float32 weights), or use strategy='ps'."
        )
    if any(p.requires_grad and not p.is_floating_point() for p in params):
        raise ValueError(
            f"ps_ring found trainable tensors of {kinds[0][0]}: expected a floating dtype (gradients are averaged)."
        )
    if not spec.elementwise:
        raise ValueError(
            f"ps_ring found {spec.optimizer_class.__qualname__}, which is not an elementwise optimizer: expected "
            "one whose update of an element depends on that element alone (torch.optim's SGD, Adam, AdamW, "
            "Adagrad, Adamax, NAdam, RAdam, RMSprop, Rprop), because each shard is a chunk of the ring that cuts "
            "tensors anywhere. Fix: use one of those, or strategy='ps' for a layer-wise one (LAMB, LARS), whose "
            "shards hold whole tensors."
        )
