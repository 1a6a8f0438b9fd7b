"""Pushes overlapped with backward, pulls with the next forward (no Lightning import).

As DDP's reducer, the worker's trainable tensors are grouped into buckets in reverse of the optimizer's
flat order (about the order backward produces their gradients), the first one small (1 MiB) so the first
push leaves early. When the last gradient of a bucket is accumulated, the bucket's slices go to the shards
holding them, one push per shard involved; a shard steps once every worker's every slice is in and answers
each worker's last part with its new values. The optimizer step then returns: each module that holds
parameters waits, before its forward, only for the shards holding them and writes their values in, so the
first layers start computing while the later layers' values are still on their way (BytePS' priority of
the next forward's first layers). Everything else that reads the parameters waits for every shard
(:meth:`OverlappedPush.settle`).

Each step's timestamps (first push sent, backward end, every pull's arrival and landing, next forward's
start) and the push bytes sent before backward ended are kept in :attr:`OverlappedPush.timeline`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from torch.futures import Future

from lightning_strategies.comm.heartbeat import PeerDiagnosis, add_abort_hook
from lightning_strategies.comm.ps.client import ParameterServerClient, WaitAbort
from lightning_strategies.comm.ps.plan import Slice
from lightning_strategies.comm.rpc import is_failure

__all__ = [
    "DEFAULT_FIRST_BUCKET_MB",
    "Bucket",
    "OverlappedPush",
    "StepTimeline",
    "bucket_caps",
    "bucket_groups",
    "plan_buckets",
]

#: DDP's first bucket (``torch.distributed``'s default first bucket bytes): small, so a push leaves early.
DEFAULT_FIRST_BUCKET_MB = 1.0
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Tensors whose gradients are pushed together.

    Attributes:
        tensors: flat indices of its tensors, in the order backward is expected to produce them.
        parts: per shard holding any of them, the indices (into that shard's plan) of its slices here.
    """

    tensors: tuple[int, ...]
    parts: dict[int, tuple[int, ...]]


def bucket_caps(bucket_cap_mb: float, first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB) -> dict[str, int]:
    """``bucket_cap_mb`` and the first bucket's cap in bytes (at least 1), as :func:`bucket_groups` takes them."""
    return {"cap_bytes": max(1, int(bucket_cap_mb * _MIB)), "first_cap_bytes": max(1, int(first_bucket_mb * _MIB))}


def bucket_groups(
    nbytes: Sequence[int], *, cap_bytes: int, first_cap_bytes: int = int(DEFAULT_FIRST_BUCKET_MB * _MIB)
) -> list[list[int]]:
    """The tensors of each bucket, in reverse flat order, each closed once it holds ``cap_bytes`` or more
    (the first ``first_cap_bytes``), as DDP's ``compute_bucket_assignment_by_size``: consecutive indices.

    Raises:
        ValueError: for a cap below one byte.
    """
    if cap_bytes < 1 or first_cap_bytes < 1:
        raise ValueError(
            f"bucket caps of {cap_bytes} and {first_cap_bytes} bytes (first bucket): expected at least 1 byte. "
            "Fix: pass a positive bucket_cap_mb."
        )
    groups: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(nbytes))):
        groups[-1].append(i)
        size += nbytes[i]
        if size >= (first_cap_bytes if len(groups) == 1 else cap_bytes):
            groups.append([])
            size = 0
    return [g for g in groups if g]


def plan_buckets(
    nbytes: Sequence[int],
    plan: Sequence[Sequence[Slice]],
    *,
    cap_bytes: int,
    first_cap_bytes: int = int(DEFAULT_FIRST_BUCKET_MB * _MIB),
) -> list[Bucket]:
    """Buckets over the tensors in reverse flat order, each closed once it holds ``cap_bytes`` or more
    (the first ``first_cap_bytes``), as DDP's ``compute_bucket_assignment_by_size``.

    Args:
        nbytes: gradient bytes of each tensor, in the optimizer's flat order.
        plan: per shard, its slices (:func:`~lightning_strategies.comm.ps.partition_parameters`).

    Raises:
        ValueError: for a cap below one byte.
    """
    groups = bucket_groups(nbytes, cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes)
    where: dict[int, list[tuple[int, int]]] = {}  # tensor -> (shard, index in the shard's plan)
    for s, slices in enumerate(plan):
        for k, sl in enumerate(slices):
            where.setdefault(sl.tensor, []).append((s, k))
    buckets = []
    for group in groups:
        parts: dict[int, list[int]] = {}
        for i in group:
            for s, k in where.get(i, []):
                parts.setdefault(s, []).append(k)
        buckets.append(Bucket(tuple(group), {s: tuple(sorted(ks)) for s, ks in sorted(parts.items())}))
    return buckets


@dataclass
class StepTimeline:
    """One step of the overlapped push and pull, in ``time.perf_counter()`` seconds.

    Attributes:
        step: the step (the client's count when its pushes went out).
        first_push: the first push of the step was sent.
        first_node_reduce: the hierarchical push's first in-node reduce-scatter of the step was launched.
        backward_end: the step's backward ended (the optimizer step began).
        pull_arrived: per shard, its values reply arrived.
        pull_landed: per shard (hierarchical push, replies per bucket: per bucket), its values were written into
            the parameters.
        next_forward: the next step's first forward started (its first wait for values).
        aligned: the step's alignment of the workers ended (``None``: none, see
            :attr:`ParameterServerClient.align`); after every worker's values of the last step landed.
        bytes_pushed: push bytes of the step; ``bytes_before_backward_end``: those sent before it ended.
    """

    step: int
    first_push: float | None = None
    first_node_reduce: float | None = None
    backward_end: float | None = None
    pull_arrived: dict[int, float] = field(default_factory=dict)
    pull_landed: dict[int, float] = field(default_factory=dict)
    next_forward: float | None = None
    aligned: float | None = None
    bytes_pushed: int = 0
    bytes_before_backward_end: int = 0

    @property
    def overlap_share(self) -> float:
        """Share of the step's push bytes sent before backward ended."""
        return self.bytes_before_backward_end / self.bytes_pushed if self.bytes_pushed else 0.0


class OverlappedPush:
    """A worker's bucketed push during backward and lazy pull before each module's forward.

    Wire it up with :meth:`grad_ready` as every trainable tensor's post-accumulate-grad hook,
    :meth:`wait_for` as a forward pre-hook of each module holding parameters, and :meth:`end_backward` then
    :meth:`flush` at the optimizer step; :attr:`enabled` off while accumulating micro-batches (DDP's
    ``no_sync``). Every wait is bounded by the client's RPC timeout, and an error names the shard.

    Args:
        client: the worker's client; its ``params`` are the tensors, its ``step`` the step pushed.
        lrs: the worker's current learning rate of each param group (read at every push).
        bucket_cap_mb: a bucket's size (DDP's ``bucket_cap_mb``).
        first_bucket_mb: the first bucket's size.
        history: steps kept in :attr:`timeline`.
    """

    def __init__(
        self,
        client: ParameterServerClient,
        lrs: Callable[[], Sequence[float]],
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB,
        history: int = 256,
    ) -> None:
        self.client = client
        self._lrs = lrs
        nbytes = [p.numel() * p.element_size() for p in client.params]
        self.buckets = plan_buckets(nbytes, client.plan, **bucket_caps(bucket_cap_mb, first_bucket_mb))
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.tensors}
        self._shards_of: list[set[int]] = [set() for _ in client.params]
        for s, slices in enumerate(client.plan):
            for sl in slices:
                self._shards_of[sl.tensor].add(s)
        #: Off while accumulating micro-batches: gradients are neither pushed nor checked.
        self.enabled = True
        self.timeline: deque[StepTimeline] = deque(maxlen=history)
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._pushed = [False] * len(self.buckets)
        self._parts: dict[int, list[Future[Any]]] = {}  # this step's pushes, per shard
        self._in_flight: dict[int, Future[Any]] = {}  # the last step's replies not yet landed, per shard
        self._stale: set[int] = set()  # tensors whose shard's values have not landed yet
        self._read_stale: set[int] = set()  # those stale when this step's backward began
        self._pushing: StepTimeline | None = None
        self._waited_since_flush = True
        # set (to the reason) when the peer watch aborts this process's communication: a wait for a frozen
        # host's reply is on a connection TensorPipe does not fail when it is shut down
        self._aborted = WaitAbort()
        _LIVE.add(self)

    @property
    def pushing(self) -> bool:
        """Whether a step's pushes have begun and not all have been sent (a failure then leaves shards
        waiting for the rest: its replies never come)."""
        return self._pushing is not None

    # -- backward: push buckets as they fill ------------------------------------------------------

    def grad_ready(self, index: int) -> None:
        """Tensor ``index``'s gradient of this backward is accumulated: push its bucket once full.

        Raises:
            RuntimeError: when the tensor was read by a forward before its new values landed (outside
                the forward of every module that holds it), or its gradient came twice in one step.
        """
        if not self.enabled:
            return
        if self._pushing is None:
            # what the forward read before its values landed: checked per tensor, as its gradient comes
            self._read_stale = set(self._stale)
            self._pushing = self._begin_step()
        self._check_fresh(index)
        b = self._bucket_of[index]
        if self._pushed[b] or index in self._ready[b]:
            raise RuntimeError(
                f"worker {self.client.worker}: the gradient of trainable tensor {index} (optimizer order) was "
                f"accumulated twice in step {self.client.step}, after its bucket was pushed. Expected one "
                "backward per optimizer step. Fix: call backward once per step, or pass overlap=False."
            )
        self._ready[b].add(index)
        if len(self._ready[b]) == len(self.buckets[b].tensors):
            self._push(b)

    def _begin_step(self, *, backward_ended: bool = False) -> StepTimeline:
        """Land the last step's values (a shard takes step k + 1 only after answering step k), then align the
        workers' pushes (the client's ``align``, if any)."""
        self.settle()
        backward_end = time.perf_counter() if backward_ended else None
        return StepTimeline(self.client.step, backward_end=backward_end, aligned=self.client.align_step())

    def _check_fresh(self, index: int) -> None:
        if index in self._read_stale:
            raise RuntimeError(
                f"worker {self.client.worker}: trainable tensor {index} (optimizer order) got a gradient in step "
                f"{self.client.step}, but no module holding it ran its forward since the servers' last values "
                f"(shard(s) {sorted(self._shards_of[index])}) were due: the forward read its previous values. "
                "Expected every trainable tensor to be read inside the forward of a module that holds it (or "
                "directly in the LightningModule). Fix: read it through its module, or pass overlap=False."
            )

    def _push(self, b: int) -> None:
        timeline = self._pushing
        assert timeline is not None
        grads = [p.grad for p in self.client.params]
        lrs = list(self._lrs())
        sent = self.client.stats.bytes_sent
        for s, part in self.buckets[b].parts.items():
            self._parts.setdefault(s, []).append(self.client.push_part(s, part, grads, lrs))
        self._pushed[b] = True
        if timeline.first_push is None:
            timeline.first_push = time.perf_counter()
        nbytes = self.client.stats.bytes_sent - sent
        timeline.bytes_pushed += nbytes
        if timeline.backward_end is None:
            timeline.bytes_before_backward_end += nbytes

    def _drain(self) -> None:
        """Send whatever :meth:`_push` left to send (the flat push sends at once: nothing)."""

    def end_backward(self) -> None:
        """The step's backward has ended (call it before :meth:`flush`)."""
        if self._pushing is not None:
            self._pushing.backward_end = time.perf_counter()

    def flush(self) -> None:
        """Push every bucket not pushed yet (a tensor without a gradient goes as ``None``), then return
        without waiting: the replies land in :meth:`wait_for` or :meth:`settle`."""
        if self._pushing is None:
            self._pushing = self._begin_step(backward_ended=True)
        for b in range(len(self.buckets)):
            if not self._pushed[b]:
                self._push(b)
        self._drain()
        timeline, self._pushing = self._pushing, None
        assert timeline is not None
        self.timeline.append(timeline)
        self._in_flight = {s: _last_of(futures, timeline.pull_arrived, s) for s, futures in self._parts.items()}
        self._stale = {i for s in self._in_flight for sl in self.client.plan[s] for i in [sl.tensor]}
        self._parts = {}
        self._ready = [set() for _ in self.buckets]
        self._pushed = [False] * len(self.buckets)
        self._waited_since_flush = False
        self.client.step += 1

    # -- the next forward: land the values each module needs ------------------------------------

    def wait_for(self, tensors: Iterable[int]) -> None:
        """Land the values holding ``tensors`` (flat indices): a module's forward pre-hook."""
        due = self._due_units()
        if not due:
            return
        if not self._waited_since_flush:
            self._waited_since_flush = True
            self.timeline[-1].next_forward = time.perf_counter()
        units = self._units_of(tensors) & due
        if units:
            self._land_units(units)

    def settle(self) -> None:
        """Land every value of the last step (before a push, evaluation, a checkpoint, the end)."""
        due = self._due_units()
        if due:
            self._land_units(set(due))

    # the units values land in: shards here, buckets under the hierarchical push (a subclass)
    def _due_units(self) -> AbstractSet[int]:
        """The units whose values of the last step have not landed."""
        return self._in_flight.keys()

    def _units_of(self, tensors: Iterable[int]) -> set[int]:
        return {s for i in tensors for s in self._shards_of[i]}

    def _land_units(self, units: set[int]) -> None:
        self._land(units)

    def settle_if_arrived(self) -> bool:
        """Land the last step's values if every shard's have arrived, without waiting; else forget them,
        leaving the previous step's values everywhere (a failed run: some may never come). Returns
        whether they landed."""
        arrived = not self._pushing and all(f.done() and not is_failure(f) for f in self._in_flight.values())
        if arrived:
            self.settle()
        self.drop()
        return arrived

    def drop(self) -> None:
        """Forget the replies and pushes in flight (the run failed: they may never come)."""
        self._in_flight, self._parts, self._stale, self._pushing = {}, {}, set(), None
        self._ready = [set() for _ in self.buckets]
        self._pushed = [False] * len(self.buckets)

    def _land(self, shards: set[int]) -> None:
        start = time.perf_counter()
        try:
            replies = self.client._wait_all(self._in_flight, shards, abort=self._aborted)
        except BaseException:
            self.drop()
            raise
        timeline = self.timeline[-1]
        for s, parts in replies.items():
            for reply in parts:  # one with values, or (per-part replies) one per part
                self.client._apply_reply(s, reply, reply.part)
            self.client.last_server_bytes[s] = max(reply.step_bytes for reply in parts)
            del self._in_flight[s]
            timeline.pull_landed[s] = time.perf_counter()
        self._stale = {i for i in self._stale if self._shards_of[i] & self._in_flight.keys()}
        waited = time.perf_counter() - start
        self.client.last_wait_seconds = waited
        self.client.stats.seconds += waited


_LIVE: weakref.WeakSet[OverlappedPush] = weakref.WeakSet()


def _abort_waits(diagnosis: PeerDiagnosis | None) -> None:
    """The heartbeat's abort hook: every wait for values fails at once, now and later."""
    text = diagnosis.describe("parameter_server") if diagnosis is not None else None
    reason = text.splitlines()[0] if text else "a peer is gone"
    for push in list(_LIVE):
        push._aborted.set(reason)


add_abort_hook(_abort_waits)


def _last_of(futures: list[Future[Any]], arrived: dict[int, float], s: int) -> Future[Any]:
    """One future for a shard's parts of a step: the first failure among them, else every part's reply (one
    holds the shard's values, or, when the shard answers each part, each its own); the arrival time of the
    last goes into ``arrived``."""
    out: Future[Any] = Future()
    lock = threading.Lock()
    left = [len(futures)]

    def done(fut: Future[Any]) -> None:
        failed = is_failure(fut)
        with lock:
            left[0] -= 1
            if out.done() or not (failed or left[0] == 0):
                return
            if not failed:
                arrived[s] = time.perf_counter()
        try:
            out.set_result(fut.value() if failed else [f.value() for f in futures])
        except Exception as err:  # the RPC itself failed: the waiter re-raises it, naming the shard
            out.set_exception(err)

    for fut in futures:
        fut.add_done_callback(done)
    return out
