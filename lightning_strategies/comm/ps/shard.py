"""One parameter server shard: a barrier over the workers' pushes, and the optimizer over its slices (its
state: :mod:`.shard_state`; the shards this process hosts and their RPC entry points: :mod:`.hosting`).

On a GPU the step runs on the
shard's own stream and every reply is a snapshot handed out through a stream-aware future
(:class:`~lightning_strategies.comm.streams.StreamOrder`), chosen over staging through pinned CPU
buffers (a device-to-host copy and a host wait per push); ``benchmarks/ps_snapshot.py`` measures it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from torch import Tensor
from torch.futures import Future

from lightning_strategies.comm.ps.clip import ShardClipping
from lightning_strategies.comm.ps.plan import Slice, as_slice
from lightning_strategies.comm.ps.shard_state import ShardState
from lightning_strategies.comm.ps.spec import OptimizerSpec
from lightning_strategies.comm.ps.wire import Packed, pack, payload_bytes, unpack
from lightning_strategies.comm.rpc import ShardError, completed
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.comm.streams import StreamBackend, StreamOrder

__all__ = ["ParameterShard", "ShardReply"]


@dataclass
class ShardReply:
    """A shard's answer to one push.

    Attributes:
        values: the shard's tensors after the step, packed (the same payload for every worker);
            ``None`` in the ack of a worker's part that is not its last (no values: bytes must not
            multiply with the number of parts).
        version: optimizer steps the shard has taken (the workers' step count).
        step_bytes: payload bytes the shard received plus sent for this step (all workers), so every
            worker can log the busiest shard without an extra collective. A reply per part carries the
            step's bytes so far: the largest of a step's replies is the step's total.
        part: the slices (indices into the shard's plan) ``values`` holds, in that order, when the shard
            answers each part on its own (``reply_per_part``); ``None``: every slice.
    """

    values: Packed | None
    version: int
    step_bytes: int
    part: tuple[int, ...] | None = None


@dataclass
class _PendingStep:
    grads: dict[int, list[Tensor | None]] = field(default_factory=dict)
    # per worker, the slices received this step (a worker may push its slices in several parts)
    received: dict[int, set[int]] = field(default_factory=dict)
    futures: dict[int, Future[ShardReply | ShardError]] = field(default_factory=dict)
    lrs: list[float] | None = None
    bytes_in: int = 0
    deadline: float | None = None  # time.monotonic() by which the last push must arrive
    # reply_per_part: per slice, the workers' pushes of it so far; the slices stepped; the parts not answered
    counts: dict[int, int] = field(default_factory=dict)
    stepped: set[int] = field(default_factory=set)
    waiting: list[tuple[int, tuple[int, ...], Future[ShardReply | ShardError]]] = field(default_factory=list)
    bytes_out: int = 0

    def open_futures(self) -> list[tuple[int, Future[ShardReply | ShardError]]]:
        """The (worker, future) pairs not answered yet."""
        return [*self.futures.items(), *((w, f) for w, _, f in self.waiting)]

    def count(self, slices: Sequence[int], num_workers: int) -> list[int]:
        """One more push of each of ``slices``; returns those every worker has now pushed."""
        complete = []
        for k in slices:
            self.counts[k] = self.counts.get(k, 0) + 1
            if self.counts[k] == num_workers:
                complete.append(k)
        return complete

    def stepped_now(self, slices: Sequence[int]) -> dict[tuple[int, ...], list[Future[ShardReply | ShardError]]]:
        """``slices`` stepped: drop their pushed gradients, and take the waiting parts whose every slice has
        stepped (their futures, by part)."""
        for grads in self.grads.values():
            for k in slices:
                grads[k] = None
        self.stepped.update(slices)
        ready: dict[tuple[int, ...], list[Future[ShardReply | ShardError]]] = {}
        waiting = []
        for worker, part, fut in self.waiting:
            if self.stepped.issuperset(part):
                ready.setdefault(part, []).append(fut)
            else:
                waiting.append((worker, part, fut))
        self.waiting = waiting
        return ready

    def replies(
        self,
        ready: dict[tuple[int, ...], list[Future[ShardReply | ShardError]]],
        params: Sequence[Tensor],
        version: int,
    ) -> list[tuple[list[Future[ShardReply | ShardError]], ShardReply]]:
        """The answer of each ready part: a snapshot of its slices' values (one for every worker waiting for it,
        as the whole step's reply), carrying the step's bytes so far."""
        answers = []
        for part, futures in ready.items():
            values = pack([params[k] for k in part])
            self.bytes_out += len(futures) * values.nbytes
            whole = part == tuple(range(len(params)))
            answers.append(
                (futures, ShardReply(values, version, self.bytes_in + self.bytes_out, None if whole else part))
            )
        return answers


def _check_reply_per_part(shard_id: int, spec: OptimizerSpec, clipping: ShardClipping | None) -> None:
    if clipping is not None or not spec.elementwise:
        raise ValueError(
            f"parameter server shard {shard_id}: reply_per_part steps part of the shard's tensors at a time, "
            f"found {'clipping (a global norm over every tensor)' if clipping is not None else ''}"
            f"{'' if spec.elementwise else spec.optimizer_class.__qualname__ + ' (not elementwise)'}. Expected "
            "no clipping and an optimizer of OptimizerSpec.elementwise. Fix: pass reply_per_part=False."
        )


class ParameterShard(ShardState):
    """One server shard: slices of the flattened parameters and the optimizer over them, each slice a
    parameter of its own in its tensor's param group.

    When the last worker's push of a step arrives, the shard averages the gradients as DDP does, steps,
    and answers every worker with the new values. Pushes arrive on RPC threads and the co-located
    worker's; the step runs on the last pusher's, and futures are completed outside the lock.

    Args:
        shard_id: index of this shard (the rank that hosts it).
        slices: what it holds, in flat order: :class:`Slice` s, or indices of whole tensors.
        params: their initial values (copied): for a slice, its elements in any shape.
        num_workers: workers that push every step (the barrier's width).
        timeout: how long the barrier waits for a step's last worker before failing every waiting
            worker with an error that names the missing ones.
        streams: the stream operations of :class:`~lightning_strategies.comm.streams.StreamOrder`
            (default: CUDA streams for tensors on a GPU, none on CPU; tests pass a fake).
        pusher_ranks: the global rank of each pusher, for errors (default: pusher ``w`` is rank ``w``).
            Under a hierarchical push (:mod:`.hierarchy`) the pushers are nodes, each pushing a sum of
            gradients its workers already divided by the world size: then ``average=False``.
        average: divide each push by the number of pushers before summing (DDP's mean of the workers).
        clipping: what to clip of the averaged gradient before the step (:mod:`~lightning_strategies.comm.ps.clip`:
            by value, or by the global norm the shards agree on); ``None``: nothing.
        reply_per_part: step each slice as soon as every worker has pushed it, and answer each part of a
            worker's push with its own slices' new values once they are stepped, instead of one step and
            one reply per shard after every slice is in: the first buckets' values travel back while the
            later buckets are still being pushed. Exact only for an optimizer that updates each tensor
            from its own gradient and state (:attr:`OptimizerSpec.elementwise`), without clipping.

    Raises:
        ValueError: for ``reply_per_part`` with clipping or with an optimizer that is not elementwise.
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
        pusher_ranks: Sequence[int] | None = None,
        average: bool = True,
        clipping: ShardClipping | None = None,
        reply_per_part: bool = False,
    ) -> None:
        if reply_per_part:
            _check_reply_per_part(shard_id, spec, clipping)
        if len(slices) != len(params):
            raise ValueError(f"{len(slices)} slices for {len(params)} tensors")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, found {num_workers}")
        self.slices = [as_slice(sl, p.numel()) for sl, p in zip(slices, params, strict=True)]
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
        self.pusher_ranks = list(pusher_ranks) if pusher_ranks is not None else list(range(num_workers))
        if len(self.pusher_ranks) != num_workers:
            raise ValueError(f"{len(self.pusher_ranks)} pusher ranks for {num_workers} pushers")
        self.average = average
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
        self._watch_until = math.inf  # when the watchdog wakes up by itself (inf: only when notified)
        self._closed = False
        self._pending = _PendingStep()
        self._failure: str | None = None
        self.clipping = clipping
        self.reply_per_part = reply_per_part

    # -- pushes -------------------------------------------------------------------------------

    def push(
        self,
        worker: int,
        step: int,
        grads: list[Tensor | None],
        lrs: list[float],
        part: Sequence[int] | None = None,
    ) -> Future[ShardReply | ShardError]:
        """Take worker ``worker``'s gradients for step ``step``, all at once or in parts (as its backward
        produces them); the future of the worker's last part holds the new values, an earlier part's an
        ack without values (or a :class:`ShardError`). Under ``reply_per_part`` every part's future holds
        the new values of its own slices, once every worker has pushed them.

        Args:
            step: the worker's step count: every worker pushes every slice of the shard's current step
                exactly once.
            grads: one gradient (or ``None`` for an unused tensor) per slice of ``part``.
            lrs: the worker's current learning rate of every param group (the last part's are used).
            part: the indices of the slices ``grads`` are for (``None``: every slice, in order).
        """
        # completed later, maybe on another thread: a stream-aware future set on the shard stream
        fut: Future[ShardReply | ShardError] = self._order.future()
        nbytes = payload_bytes(grads)
        with self._lock:
            self.stats.bytes_received += nbytes
            self.stats.calls += 1
            error = self._check_push(worker, grads, lrs, part) or self._check_step(worker, step, part)
            if error is not None:
                fut.set_result(ShardError(error))
                return fut
            # the gradients were made (or received) on this thread's stream: the step waits for them
            self._order.take(grads)
            pending = self._pending
            self._take_part(pending, worker, grads, part)
            pending.lrs = lrs
            pending.bytes_in += nbytes
            if pending.deadline is None and self.num_workers > 1:
                pending.deadline = time.monotonic() + self.timeout.total_seconds()
                self._start_watchdog()
                # deadlines only grow: a watchdog asleep until an earlier one finds this one when it wakes; a
                # wake-up per step cost a context switch and a hand-over of the GIL, on the training thread too
                if self._watch_until > pending.deadline:
                    self._cond.notify()
            if self.reply_per_part:
                answers = self._step_parts(pending, worker, part, fut)
                stepped = None
            elif len(pending.received[worker]) < len(self.params):
                fut.set_result(ShardReply(None, self.version, 0))  # an earlier part: an ack at once
                return fut
            else:
                pending.futures[worker] = fut
                if len(pending.futures) < self.num_workers:
                    return fut
                self._pending = _PendingStep()  # the watchdog finds no deadline: nothing to fail
                sent = self.num_workers * self._values_bytes
                self.stats.bytes_sent += sent
                with self._order.running():
                    stepped = self._step([pending.grads[w] for w in range(self.num_workers)], pending.lrs)
        if stepped is None:
            for futures, reply in answers:
                self._order.complete(futures, reply)
            return fut
        # the step ends now, or once the shards agree on the gradient norm (outside the lock: see clip.py)
        stepped.add_done_callback(lambda done: self._reply(pending, sent, done))
        return fut

    def _reply(self, pending: _PendingStep, sent: int, stepped: Future[float | ShardError | None]) -> None:
        """Finish a step :meth:`_step` left waiting for the agreed norm, then answer every worker."""
        try:
            with self._lock:
                norm = stepped.value()
                if isinstance(norm, ShardError):
                    self._failure = self._failure or norm.message
                    reply: ShardReply | ShardError = norm
                else:
                    with self._order.running():
                        if norm is not None:
                            self._apply(norm)
                        # a snapshot, one for every worker: packing copies once per step, not once per worker,
                        # and no later step can change a reply still being read or sent
                        reply = ShardReply(pack(self.params), self.version, pending.bytes_in + sent)
        except Exception as err:  # a callback's exception would be lost, and the workers left waiting
            reply = ShardError(f"parameter server shard {self.shard_id} failed in step {self.version}: {err!r}")
        self._order.complete([pending.futures[w] for w in sorted(pending.futures)], reply)

    def _take_part(
        self, pending: _PendingStep, worker: int, grads: list[Tensor | None], part: Sequence[int] | None
    ) -> None:
        if part is None:  # a copy: reply_per_part drops each slice's gradient once stepped
            pending.grads[worker], pending.received[worker] = list(grads), set(range(len(self.params)))
            return
        mine = pending.grads.setdefault(worker, [None] * len(self.params))
        for k, g in zip(part, grads, strict=True):
            mine[k] = g
        pending.received.setdefault(worker, set()).update(part)

    def _step_parts(
        self,
        pending: _PendingStep,
        worker: int,
        part: Sequence[int] | None,
        fut: Future[ShardReply | ShardError],
    ) -> Sequence[tuple[list[Future[ShardReply | ShardError]], ShardReply | ShardError]]:
        """``reply_per_part``, under the lock: step the slices every worker has now pushed, and return the
        answers of the parts whose slices have all stepped (completed outside the lock)."""
        ks = tuple(range(len(self.params))) if part is None else tuple(part)
        pending.waiting.append((worker, ks, fut))
        complete = pending.count(ks, self.num_workers)
        if not complete:
            return []
        with self._order.running():
            try:
                if self.optimizer is not None:
                    self._average([pending.grads[w] for w in range(self.num_workers)], complete)
                    self._set_lrs(pending.lrs)
                    # the tensors without a gradient (every slice but these) are left alone by the optimizer
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            except Exception as err:  # every waiting worker gets the error, and so does every later push
                self._failure = f"parameter server shard {self.shard_id} failed in step {self.version}: {err!r}"
                self._pending = _PendingStep()
                return [([f for _, f in pending.open_futures()], ShardError(self._failure))]
            ready = pending.stepped_now(complete)
            if len(pending.stepped) == len(self.params):
                self.version += 1
                self._pending = _PendingStep()  # the watchdog finds no deadline: nothing to fail
            before = pending.bytes_out
            answers = pending.replies(ready, self.params, self.version)
        self.stats.bytes_sent += pending.bytes_out - before
        return answers

    def _check_push(
        self, worker: int, grads: list[Tensor | None], lrs: list[float], part: Sequence[int] | None = None
    ) -> str | None:
        """What is wrong with a push, whatever its step (``None``: nothing)."""
        where = f"parameter server shard {self.shard_id}"
        if self._failure is not None:
            return f"{where} has failed earlier and takes no more pushes: {self._failure}"
        if not 0 <= worker < self.num_workers:
            return f"{where}: push from worker {worker}, expected a worker in [0, {self.num_workers})"
        expected = len(self.params) if part is None else len(part)
        if len(grads) != expected:
            return f"{where}: worker {worker} pushed {len(grads)} gradients, expected {expected}"
        if part is not None and (len(set(part)) != len(part) or not all(0 <= k < len(self.params) for k in part)):
            return (
                f"{where}: worker {worker} pushed a part for slices {list(part)}, expected distinct slices "
                f"in [0, {len(self.params)})"
            )
        if len(lrs) != len(self.spec.group_sizes):
            return (
                f"{where}: worker {worker} sent {len(lrs)} learning rates, expected one per param group "
                f"({len(self.spec.group_sizes)})"
            )
        return None

    def _check_step(self, worker: int, step: int, part: Sequence[int] | None = None) -> str | None:
        """What is wrong with the step of a push to the barrier (``None``: nothing)."""
        where = f"parameter server shard {self.shard_id}"
        if step != self.version:
            return (
                f"{where}: worker {worker} pushed step {step} while the shard is at step {self.version}; "
                "every worker must push every step once (did a worker skip an "
                "optimizer step, e.g. a training_step returning None on one rank only?)"
            )
        received = self._pending.received.get(worker)
        if received and (part is None or not received.isdisjoint(part)):
            return f"{where}: worker {worker} pushed step {step} twice"
        return None

    # -- the barrier's timeout ----------------------------------------------------------------

    def _start_watchdog(self) -> None:
        # one thread for the shard's life (until close()) instead of a timer per step: it sleeps until the
        # deadline of the step open when it fell asleep, then until the open step's (a step that completes
        # first leaves it nothing to do), so it wakes about once per timeout, not once per step
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
                    self._watch_until = math.inf if deadline is None else deadline
                    self._cond.wait(None if deadline is None else deadline - now)
                pending = self._expire()
            # the remote workers' errors first: once the co-located worker (index == shard_id)
            # wakes up it fails and shuts RPC down, which would drop replies not yet on the wire
            assert self._failure is not None
            co_located_last = sorted(
                pending.open_futures(), key=lambda x: (self.pusher_ranks[x[0]] == self.shard_id, x[0])
            )
            for _, fut in co_located_last:
                fut.set_result(ShardError(self._failure, timed_out=True))

    def _expire(self) -> _PendingStep:
        """Fail the open step (under the lock); the caller completes its futures outside the lock."""
        pending = self._pending
        # a worker is in once it pushed every slice (its last part)
        complete = [w for w in range(self.num_workers) if len(pending.received.get(w, ())) == len(self.params)]
        missing = [self.pusher_ranks[w] for w in range(self.num_workers) if w not in complete]
        self._failure = (
            f"parameter server shard {self.shard_id} waited {self.timeout.total_seconds():.0f}s for "
            f"the gradients of step {self.version} from worker(s) {missing} (received from "
            f"{sorted(self.pusher_ranks[w] for w in complete)}). Worker(s) {missing} died or are stuck; "
            "check their logs. "
            "To wait longer for slow workers, raise the strategy's `timeout`."
        )
        self._pending = _PendingStep()
        return pending

    def close(self, reason: str | None = None) -> str | None:
        """Stop the watchdog thread (and wait, a few seconds at most, until it has ended): the shard is being
        dropped.

        Args:
            reason: why, when the host failed (the failure's first line): the workers waiting in the
                barrier get an error carrying it at once, so a survivor names the lost peer instead of
                waiting for the timeout. Without one (a clean teardown) pending pushes stay pending.

        Returns:
            The error later pushes to this shard's id should get (``None`` without a reason).
        """
        if self.clipping is not None:
            self.clipping.close(reason)  # an open norm agreement fails its step at once
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if reason is not None:
                if self._failure is None:
                    self._failure = f"parameter server shard {self.shard_id} stopped because its host failed: {reason}"
                pending, self._pending = self._pending, _PendingStep()
                failure = self._failure
        # a thread left to end on its own may still be ending when the interpreter exits, which aborts it
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5.0)
        if reason is None:
            return None
        for _, fut in sorted(pending.open_futures(), key=lambda x: x[0]):
            fut.set_result(ShardError(failure))
        return failure

    # -- optimizer ----------------------------------------------------------------------------

    def _step(
        self, grads_by_worker: list[list[Tensor | None]], lrs: Sequence[float] | None
    ) -> Future[float | ShardError | None]:
        """Average the workers' gradients and step; a future of ``None`` once stepped. When clipping needs the
        global gradient norm, which the other shards' parts complete, the future of that norm (or of the
        agreement's :class:`ShardError`) instead: :meth:`_reply` then ends the step with :meth:`_apply`."""
        if self.optimizer is None:
            self.version += 1
            return completed(None)
        self._average(grads_by_worker, range(len(self.params)))
        self._set_lrs(lrs)
        agreed: float | None = None
        if self.clipping is not None:
            norm = self.clipping.start(self.version, self.params)
            value = norm.value() if norm.done() else None
            if not norm.done() or isinstance(value, ShardError):
                return norm  # the push's callback ends the step (or fails it) once the shards agree
            agreed = value
        self._apply(agreed)
        return completed(None)

    def _average(self, grads_by_worker: list[list[Tensor | None]], slices: Iterable[int]) -> None:
        """The workers' mean gradient (their sum without ``average``) of each of ``slices``, as its ``grad``."""
        n = len(grads_by_worker) if self.average else 1
        for i in slices:
            p = self.params[i]
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

    def _set_lrs(self, lrs: Sequence[float] | None) -> None:
        """The workers' lr of each group (LR schedulers run on the workers)."""
        if lrs is not None and self.optimizer is not None:
            for group, worker_group in zip(self.optimizer.param_groups, self._group_ids, strict=True):
                group["lr"] = lrs[worker_group]

    def _apply(self, norm: float | None) -> None:
        """The optimizer's step on the averaged gradient (clipped by the agreed global ``norm``, if any)."""
        assert self.optimizer is not None
        kwargs = self.clipping.finish(self.params, norm) if self.clipping is not None else {}
        self.optimizer.step(**kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    # -- payloads ------------------------------------------------------------------------------

    def unpack(self, packed: Packed, part: Sequence[int] | None = None) -> list[Tensor | None]:
        """A pushed payload as one gradient (or ``None``) per slice (of ``part``, when given)."""
        return unpack(packed, self.params if part is None else [self.params[k] for k in part])
