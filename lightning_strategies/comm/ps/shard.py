"""One parameter server shard (a barrier), the registry of the shards this process hosts, and their
RPC entry points.

The push handler runs under :func:`~lightning_strategies.comm.rpc.async_execution`: a blocking
handler deadlocks once the waiting pushes occupy every RPC thread. On a GPU the step runs on the
shard's own stream and every reply is a snapshot handed out through a stream-aware future
(:class:`~lightning_strategies.comm.streams.StreamOrder`), chosen over staging through pinned CPU
buffers (a device-to-host copy and a host wait per push); ``benchmarks/ps_snapshot.py`` measures it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_strategies.comm.heartbeat import PeerDiagnosis, add_abort_hook
from lightning_strategies.comm.ps.clip import ShardClipping
from lightning_strategies.comm.ps.plan import Slice, as_slice
from lightning_strategies.comm.ps.spec import OptimizerSpec, hyperparameters
from lightning_strategies.comm.ps.wire import Packed, pack, payload_bytes, unpack
from lightning_strategies.comm.rpc import ShardError, async_execution, completed, current_name
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.comm.streams import StreamBackend, StreamOrder

__all__ = [
    "ParameterShard",
    "ShardReply",
    "hosted_shard",
    "local_shard",
    "register_shard",
    "stop_hosted_shards",
    "unregister_shard",
]


@dataclass
class ShardReply:
    """A shard's answer to one push.

    Attributes:
        values: the shard's tensors after the step, packed (the same payload for every worker);
            ``None`` in the ack of a worker's part that is not its last (no values: bytes must not
            multiply with the number of parts).
        version: optimizer steps the shard has taken (the workers' step count).
        step_bytes: payload bytes the shard received plus sent for this step (all workers), so every
            worker can log the busiest shard without an extra collective.
    """

    values: Packed | None
    version: int
    step_bytes: int


@dataclass
class _PendingStep:
    grads: dict[int, list[Tensor | None]] = field(default_factory=dict)
    # per worker, the slices received this step (a worker may push its slices in several parts)
    received: dict[int, set[int]] = field(default_factory=dict)
    futures: dict[int, Future[ShardReply | ShardError]] = field(default_factory=dict)
    lrs: list[float] | None = None
    bytes_in: int = 0
    deadline: float | None = None  # time.monotonic() by which the last push must arrive


class ParameterShard:
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
    ) -> None:
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
        ack without values (or a :class:`ShardError`).

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
            if len(pending.received[worker]) < len(self.params):
                fut.set_result(ShardReply(None, self.version, 0))  # an earlier part: an ack at once
                return fut
            pending.futures[worker] = fut
            if len(pending.futures) < self.num_workers:
                return fut
            self._pending = _PendingStep()  # the watchdog finds no deadline: nothing to fail
            sent = self.num_workers * self._values_bytes
            self.stats.bytes_sent += sent
            with self._order.running():
                stepped = self._step([pending.grads[w] for w in range(self.num_workers)], pending.lrs)
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
        if part is None:
            pending.grads[worker], pending.received[worker] = grads, set(range(len(self.params)))
            return
        mine = pending.grads.setdefault(worker, [None] * len(self.params))
        for k, g in zip(part, grads, strict=True):
            mine[k] = g
        pending.received.setdefault(worker, set()).update(part)

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
            for w in sorted(pending.futures, key=lambda w: (self.pusher_ranks[w] == self.shard_id, w)):
                pending.futures[w].set_result(ShardError(self._failure, timed_out=True))

    def _expire(self) -> _PendingStep:
        """Fail the open step (under the lock); the caller completes its futures outside the lock."""
        pending = self._pending
        missing = [self.pusher_ranks[w] for w in range(self.num_workers) if w not in pending.futures]
        self._failure = (
            f"parameter server shard {self.shard_id} waited {self.timeout.total_seconds():.0f}s for "
            f"the gradients of step {self.version} from worker(s) {missing} (received from "
            f"{sorted(self.pusher_ranks[w] for w in pending.futures)}). Worker(s) {missing} died or are stuck; "
            "check their logs. "
            "To wait longer for slow workers, raise the strategy's `timeout`."
        )
        self._pending = _PendingStep()
        return pending

    def close(self, reason: str | None = None) -> str | None:
        """Stop the watchdog thread: the shard is being dropped.

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

    def _step(
        self, grads_by_worker: list[list[Tensor | None]], lrs: Sequence[float] | None
    ) -> Future[float | ShardError | None]:
        """Average the workers' gradients and step; a future of ``None`` once stepped. When clipping needs the
        global gradient norm, which the other shards' parts complete, the future of that norm (or of the
        agreement's :class:`ShardError`) instead: :meth:`_reply` then ends the step with :meth:`_apply`."""
        if self.optimizer is None:
            self.version += 1
            return completed(None)
        n = len(grads_by_worker) if self.average else 1
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
        if lrs is not None:  # the workers' lr of each group (LR schedulers run on the workers)
            for group, worker_group in zip(self.optimizer.param_groups, self._group_ids, strict=True):
                group["lr"] = lrs[worker_group]
        agreed: float | None = None
        if self.clipping is not None:
            norm = self.clipping.start(self.version, self.params)
            value = norm.value() if norm.done() else None
            if not norm.done() or isinstance(value, ShardError):
                return norm  # the push's callback ends the step (or fails it) once the shards agree
            agreed = value
        self._apply(agreed)
        return completed(None)

    def _apply(self, norm: float | None) -> None:
        """The optimizer's step on the averaged gradient (clipped by the agreed global ``norm``, if any)."""
        assert self.optimizer is not None
        kwargs = self.clipping.finish(self.params, norm) if self.clipping is not None else {}
        self.optimizer.step(**kwargs)
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

    def unpack(self, packed: Packed, part: Sequence[int] | None = None) -> list[Tensor | None]:
        """A pushed payload as one gradient (or ``None``) per slice (of ``part``, when given)."""
        return unpack(packed, self.params if part is None else [self.params[k] for k in part])

    def state_dict(self) -> dict[str, Any]:
        """This shard's optimizer state: ``{"state": {slice: its state}, "param_groups": {group: options},
        "version": steps}`` (:meth:`ParameterServerClient.gather_state_dict` joins the shards')."""
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
                    g: hyperparameters(group) for g, group in zip(self._group_ids, sd["param_groups"], strict=True)
                },
                "version": self.version,
            }

    def load_state_dict(self, full_state: Mapping[str, Any], version: int | None = None) -> None:
        """Load this shard's part of a full optimizer state dict (worker optimizer format).

        Args:
            full_state: as :meth:`ParameterServerClient.gather_state_dict` returns (or a plain
                optimizer's ``state_dict()`` of the same model).
            version: the step count to resume at (the barrier needs the workers' step).
        """
        with self._lock:
            if version is not None:
                self.version = version
            if self.optimizer is None:
                return
            groups = []
            for g in self._group_ids:
                options = hyperparameters(full_state["param_groups"][g])
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


def _copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: v.clone() if isinstance(v, Tensor) else v for key, v in state.items()}


def _slice_state(state: Mapping[str, Any], sl: Slice, param: Tensor) -> dict[str, Any]:
    """A slice's part of its tensor's optimizer state (per-element state: a tensor larger than the slice).

    Copied: ``Optimizer.load_state_dict`` keeps a ``step`` tensor as given, and slices of one tensor
    sharing it would each increment it.
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


# -- what this process hosts: RPC entry points find their shard here --------------------------

_SHARDS: dict[int, ParameterShard] = {}
# shards dropped because their host failed, with the error late pushes get: a survivor's push
# that arrives after the drop must name the failure, not suggest disagreeing sharding plans
_STOPPED: dict[int, str] = {}


def register_shard(shard: ParameterShard) -> None:
    """Make ``shard`` reachable by RPC in this process (one process may host several)."""
    _STOPPED.pop(shard.shard_id, None)
    _SHARDS[shard.shard_id] = shard


def unregister_shard(shard_id: int, *, reason: str | None = None) -> None:
    """Forget the shard (at teardown), so a later fit in this process starts clean.

    Args:
        reason: why, when this process failed: pushes waiting in the shard's barrier, and any that
            arrive until RPC shuts down, get an error carrying it.
    """
    shard = _SHARDS.pop(shard_id, None)
    if shard is not None:
        failure = shard.close(reason)  # its watchdog thread ends
        if failure is not None:
            _STOPPED[shard_id] = failure


def stop_hosted_shards(diagnosis: PeerDiagnosis | None) -> None:
    """Drop every hosted shard, answering the workers waiting in its barrier with the loss: the
    heartbeat's abort hook (a frozen worker's push never comes, and no connection ends that wait)."""
    text = diagnosis.describe("parameter_server") if diagnosis is not None else None
    reason = f"PeerLostError: {text.splitlines()[0]}" if text else "PeerLostError: a peer is gone"
    for shard_id in list(_SHARDS):
        unregister_shard(shard_id, reason=reason)


add_abort_hook(stop_hosted_shards)


def local_shard(shard_id: int) -> ParameterShard | None:
    """The shard ``shard_id`` when this process hosts it."""
    return _SHARDS.get(shard_id)


def hosted_shard(shard_id: int) -> ParameterShard:
    """The shard ``shard_id``, which this process must host (RPC entry points call this).

    Raises:
        RuntimeError: when this process does not host it.
    """
    shard = _SHARDS.get(shard_id)
    if shard is None and shard_id in _STOPPED:
        raise RuntimeError(_STOPPED[shard_id])
    if shard is None:
        raise RuntimeError(
            f"parameter server shard {shard_id} is not hosted by {current_name()} "
            f"(this process hosts {sorted(_SHARDS)}); the sharding plans of the workers disagree"
        )
    return shard


@async_execution
def _rpc_push(
    shard_id: int, worker: int, step: int, grads: Packed, lrs: list[float], part: list[int] | None = None
) -> Future[ShardReply | ShardError]:
    # returns the barrier's future at once: the RPC thread is free while the step waits
    shard = hosted_shard(shard_id)
    try:
        unpacked = shard.unpack(grads, part)
    except (ValueError, IndexError) as err:
        return completed(ShardError(f"parameter server shard {shard_id}: worker {worker} pushed {err}"))
    return shard.push(worker, step, unpacked, lrs, part)


def _rpc_state_dict(shard_id: int) -> dict[str, Any]:
    return hosted_shard(shard_id).state_dict()
