"""The worker's side of the parameter servers: push gradients, pull values, count bytes."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_strategies.comm.ps.hosting import _rpc_push, _rpc_state_dict, local_shard
from lightning_strategies.comm.ps.plan import Slice, as_slice
from lightning_strategies.comm.ps.spec import OptimizerSpec, hyperparameters
from lightning_strategies.comm.ps.wire import Packed, pack, slice_of, unpack, write_slice
from lightning_strategies.comm.rpc import call_host, is_failure, wait_reply, worker_name
from lightning_strategies.comm.stats import CommStats

__all__ = ["ParameterServerClient", "broadcast_from_rank0"]


class WaitAbort:
    """A one-shot abort of the waits for shards' replies (set by the heartbeat's abort hook): it wakes the
    waits in progress, and every later wait fails at once. A wait watches it only while it waits: a
    callback per wait on a future that is never completed would pile up, one or more per step, for the
    whole fit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Why the waits were aborted (``None``: not aborted).
        self.reason: str | None = None
        self._watchers: dict[int, Callable[[], None]] = {}
        self._keys = itertools.count()

    def set(self, reason: str) -> None:
        """Abort (once; later calls keep the first reason)."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
            watchers = list(self._watchers.values())
        for wake in watchers:
            wake()

    def watch(self, wake: Callable[[], None]) -> int | None:
        """Call ``wake`` when the abort is set (at once if it is); the key for :meth:`unwatch`."""
        with self._lock:
            if self.reason is None:
                key = next(self._keys)
                self._watchers[key] = wake
                return key
        wake()
        return None

    def unwatch(self, key: int | None) -> None:
        """Stop watching (the wait has ended)."""
        if key is not None:
            with self._lock:
                self._watchers.pop(key, None)


class ParameterServerClient:
    """A worker's handle on every shard.

    Args:
        worker: this worker's index (its global rank).
        params: the worker's trainable tensors in the optimizer's flat order; the pulled
            values are copied into them in place.
        plan: per shard, its :class:`Slice` s (:func:`partition_parameters`) or the indices of
            its whole tensors (:func:`shard_parameters`); shard ``s`` is hosted by rank ``s``.
        timeout: the barrier timeout of the shards; the RPC timeout is a little longer so the
            shard's error, which names the missing workers, arrives first.

    Attributes:
        align: ``None``, or a barrier of every worker (bounded by its own timeout) that :meth:`align_step`
            runs before each step's first push, once this worker's values of the last step have landed. A
            worker whose values landed first then does not push while its co-located shard is still sending
            its replies to the slower workers: on one link those pushes would slow the replies down, and so
            the slower workers' next push (measured on the emulated 4 x 1 cluster, docs/measured/cluster.md).
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
        self.plan = [[x if isinstance(x, Slice) else as_slice(x, self.params[x].numel()) for x in p] for p in plan]
        self.rpc_timeout = timeout.total_seconds() + max(5.0, 0.1 * timeout.total_seconds())
        self.stats = CommStats()
        self.step = 0
        self.last_wait_seconds = 0.0
        self.last_server_bytes = [0] * len(self.plan)
        self.align: Callable[[], None] | None = None

    @property
    def num_servers(self) -> int:
        return len(self.plan)

    def align_step(self) -> float | None:
        """Run :attr:`align` (call it once per step, after the last step's values landed and before the first
        push); returns when it ended (``time.perf_counter()``), or ``None`` without one."""
        if self.align is None:
            return None
        self.align()
        return time.perf_counter()

    def push_pull(self, lrs: Sequence[float]) -> None:
        """Push ``p.grad`` of every tensor to its shard, wait for all shards, copy the answers in.

        Each shard gets one payload with the worker's current learning rates (so LR schedulers on the
        worker keep working); all are in flight before any is waited on. This is the worker's only
        synchronisation point of the step, besides :attr:`align` (run first).

        Raises:
            RuntimeError: naming the shard and its host rank when a shard fails or times out.
        """
        self.align_step()
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
        futures = {
            s: call_host(s, entry, s, *args_for(idx), local=local_shard(s) is not None, timeout=self.rpc_timeout)
            for s, idx in enumerate(self.plan)
            if idx  # more shards than tensors: nothing to exchange with an empty one
        }
        self.stats.calls += len(futures)
        return self._wait_all(futures)

    def _outgoing(self, grads: Sequence[Tensor | None], slices: Sequence[Slice]) -> Packed:
        packed = pack([slice_of(g, sl) if (g := grads[sl.tensor]) is not None else None for sl in slices])
        self.stats.bytes_sent += packed.nbytes
        return packed

    def push_part(
        self, s: int, slices: Sequence[int], grads: Sequence[Tensor | None], lrs: Sequence[float]
    ) -> Future[Any]:
        """Push the gradients of slices ``slices`` (indices into shard ``s``'s plan) of this step to shard
        ``s`` without waiting: a part of the step's push (:mod:`.buckets`). The future holds an ack, or
        the shard's new values when this is the last part the shard needs from this worker.

        Args:
            grads: every tensor's gradient (or ``None``) in flat order.
        """
        packed = self._outgoing(grads, [self.plan[s][k] for k in slices])
        self.stats.calls += 1
        return call_host(
            s, _rpc_push, s, self.worker, self.step, packed, list(lrs), list(slices),
            local=local_shard(s) is not None, timeout=self.rpc_timeout,
        )  # fmt: skip

    def _apply_reply(self, s: int, reply: Any, part: Sequence[int] | None = None) -> None:
        """Write a shard's values into the parameters: every slice of its plan, or those of ``part``
        (indices into the plan: a :class:`~lightning_strategies.comm.ps.ShardReply`'s ``part``)."""
        self.last_server_bytes[s] = reply.step_bytes
        if reply.values is None:
            return
        slices = self.plan[s] if part is None else [self.plan[s][k] for k in part]
        values = unpack(reply.values, [slice_of(self.params[sl.tensor], sl) for sl in slices])
        with torch.no_grad():
            for sl, v in zip(slices, values, strict=True):
                if v is not None:  # values are always whole payloads: never None
                    write_slice(self.params[sl.tensor], sl, v)
        self.stats.bytes_received += reply.values.nbytes

    def _end_step(self, start: float) -> None:
        self.step += 1
        self.last_wait_seconds = time.perf_counter() - start
        self.stats.seconds += self.last_wait_seconds

    def _wait_all(
        self,
        futures: Mapping[int, Future[Any]],
        wanted: Collection[int] | None = None,
        *,
        abort: WaitAbort | None = None,
    ) -> dict[int, Any]:
        """The replies of the shards ``wanted`` (default: all of ``futures``), raising as soon as any of
        ``futures`` fails, wanted or not, or ``abort`` is set."""
        # not in shard order: that would report a dead host only after an earlier shard's barrier timed
        # out; a gate opened by the first failure (or the last wanted success) raises at once, naming it
        wanted = list(futures) if wanted is None else [s for s in futures if s in wanted]
        if not wanted:
            return {}
        gate: Future[int] = Future()
        lock = threading.Lock()
        pending = [len(wanted)]

        def on_done(s: int, fut: Future[Any]) -> None:
            failed = fut.done() and is_failure(fut)
            with lock:
                if s in wanted:
                    pending[0] -= 1
                if gate.done():
                    return
                if failed:
                    gate.set_result(s)
                elif pending[0] == 0:
                    gate.set_result(-1)

        def on_abort() -> None:
            with lock:
                if not gate.done():
                    gate.set_result(-2)

        for s, fut in futures.items():
            fut.add_done_callback(functools.partial(on_done, s))
        key = abort.watch(on_abort) if abort is not None else None
        try:
            first_failed = gate.wait()
        finally:
            if abort is not None:
                abort.unwatch(key)
        if first_failed == -2:
            assert abort is not None
            raise RuntimeError(
                f"worker {self.worker}: the wait for parameter server shard(s) {sorted(wanted)} at step {self.step} "
                f"was aborted: {abort.reason}"
            )
        if first_failed >= 0:
            self._wait(first_failed, futures[first_failed])  # raises, naming the shard
        return {s: self._wait(s, futures[s]) for s in wanted}

    def _wait(self, s: int, fut: Future[Any]) -> Any:
        where = (
            f"worker {self.worker}: parameter server shard {s} (hosted by rank {s}, RPC name "
            f"{worker_name(s)!r}) failed at step {self.step}"
        )
        return wait_reply(fut, where)

    def gather_state_dict(
        self, spec: OptimizerSpec, worker_param_groups: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any]:
        """Every shard's optimizer state as one ``Optimizer.state_dict()`` in the worker's flat order: it
        loads into the same optimizer over the same model on one device, or back into the shards
        (:meth:`ParameterShard.load_state_dict`). Group options come from a shard holding one of the
        group's tensors, else from ``worker_param_groups``."""
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
            options = group_options.get(g, hyperparameters(worker_group))
            if "param_names" in worker_group:
                options = {**options, "param_names": list(worker_group["param_names"])}
            groups.append({**options, "params": list(range(start, start + n))})
            start += n
        return {"state": dict(sorted(state.items())), "param_groups": groups}


def _join_state(pieces: Sequence[tuple[Slice, Mapping[str, Any]]], param: Tensor) -> dict[str, Any]:
    """One tensor's optimizer state from its slices' (in element order): per-element state concatenated,
    scalars (a step count, equal in every slice) taken once."""
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


def broadcast_from_rank0(tensors: Sequence[Tensor]) -> None:
    """Rank 0's values of ``tensors`` everywhere, one broadcast per dtype: a collective of the default
    process group (every rank passes the same tensors), for buffers the servers do not hold."""
    packed = pack(tensors)  # one flat tensor per dtype, in the order of first appearance: alike on every rank
    for flat in packed.flats:
        dist.broadcast(flat, src=0)
    with torch.no_grad():
        for t, synced in zip(tensors, unpack(packed, tensors), strict=True):
            t.copy_(synced)  # type: ignore[arg-type]  # every tensor was packed: none is None
