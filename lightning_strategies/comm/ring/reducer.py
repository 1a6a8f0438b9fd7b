"""The reducer thread: ring all-reduce of DDP's buckets on a background thread, returning futures."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from lightning_strategies.comm.ring.allreduce import hierarchical_all_reduce, ring_all_reduce
from lightning_strategies.comm.ring.check import _OPS, resolve_wire_dtype
from lightning_strategies.comm.ring.layout import NodeLayout
from lightning_strategies.comm.stats import CommStats

__all__ = ["RingBucketReducer"]

# The reducer thread's queue: (tensor, its future, the CUDA event it waits for), then None to stop.
_Work: TypeAlias = "queue.SimpleQueue[tuple[torch.Tensor, torch.futures.Future[Any], Any] | None]"


class RingBucketReducer:
    """Reduce tensors with :func:`ring_all_reduce` (or :func:`hierarchical_all_reduce`) on one
    background thread, returning futures.

    A DDP communication hook must not block backward, and gloo's point-to-point ``Work`` has no
    ``get_future()``: the hook enqueues the bucket and this thread reduces buckets in submission order
    (DDP's, the same on every rank) on a process group of its own. After a failure every later future
    fails with the same error. A reducer dropped without :meth:`close` stops its thread once collected.
    On CUDA it runs on a stream of its own and times each call with events (:meth:`pop_device_seconds`).

    Args:
        group: used only by this reducer; with ``inter_group``, this process's node.
        op: ``"sum"`` or ``"avg"`` (DDP expects ``"avg"``).
        wire_dtype, check_peers, layout: as :func:`ring_all_reduce` (``check_peers`` off by default: DDP checks).
        inter_group: this process's inter-node group: reduce hierarchically instead of one flat ring.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        op: str = "avg",
        wire_dtype: str | torch.dtype | None = None,
        check_peers: bool = False,
        inter_group: dist.ProcessGroup | None = None,
        layout: NodeLayout | None = None,
    ) -> None:
        if op not in _OPS:
            raise ValueError(f"Invalid op {op!r}: expected one of {list(_OPS)}.")
        if inter_group is not None and layout is not None:
            raise ValueError(
                "RingBucketReducer: found both inter_group and layout: expected one (the hierarchical ring knows "
                "its node split from its groups; layout is for the flat ring's byte accounting)."
            )
        self.group = group
        self.inter_group = inter_group
        self.layout = layout
        self.op = op
        self.wire_dtype = resolve_wire_dtype(wire_dtype)
        self.check_peers = check_peers
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA calls not read yet
        self._queue: _Work = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stats = CommStats()
        self._error: BaseException | None = None
        self._stream: Any = None
        self._thread = threading.Thread(
            target=_serve_reducer, args=(weakref.ref(self), self._queue), name="ring-all-reduce", daemon=True
        )
        self._thread.start()
        # The thread holds only a weak reference; finalize also runs at interpreter exit, before the modules go.
        self._stopper = weakref.finalize(self, _stop_reducer_thread, self._queue, self._thread, _EXIT_JOIN_SECONDS)

    def submit(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Queue ``tensor`` for an in-place reduction; the future's value is ``tensor``."""
        if not self._thread.is_alive():
            raise RuntimeError("RingBucketReducer is closed; create a new one to reduce more tensors.")
        event = None
        if tensor.is_cuda:
            # The bucket is written on the caller's stream; the reducer's stream waits for it,
            # and the CUDA-aware future makes the consumer's stream wait for the reduction.
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[tensor.device])
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        else:
            fut = torch.futures.Future()
        self._queue.put((tensor, fut, event))
        return fut

    def pop_stats(self) -> CommStats:
        """Everything counted since the last call (thread-safe), and reset the counters (CUDA calls: ``seconds`` 0)."""
        with self._lock:
            return self._stats.reset()

    def pop_device_seconds(self) -> tuple[float, int]:
        """Device seconds and number of the CUDA calls completed since the last call (``(0.0, 0)`` on CPU).

        Only events the device has passed are read (``Event.query``, no wait): read it at logging steps.
        """
        seconds, done = 0.0, 0
        with self._lock:
            for start, end in self._timings:
                if not end.query():  # the reducer's stream runs its calls in order: the rest are later
                    break
                seconds += start.elapsed_time(end) / 1000.0
                done += 1
            del self._timings[:done]
        return seconds, done

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once queued work is done; whether it stopped within ``timeout``.

        A thread blocked in a ring call (a hung peer) is left behind as a daemon: do not destroy its group.
        """
        self._stopper.detach()
        return _stop_reducer_thread(self._queue, self._thread, timeout)

    def _reduce(self, tensor: torch.Tensor, event: Any) -> CommStats:
        options: dict[str, Any] = {"op": self.op, "wire_dtype": self.wire_dtype, "check_peers": self.check_peers}

        def run() -> CommStats:
            if self.inter_group is not None:
                return hierarchical_all_reduce(tensor, self.group, self.inter_group, **options)
            return ring_all_reduce(tensor, self.group, layout=self.layout, **options)

        if event is None:
            return run()
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        with torch.cuda.device(tensor.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            # Recorded after the wait, so the pair times the ring itself, not the backward before it.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            stats = run()
            end.record(self._stream)
        stats.seconds = 0.0  # host time to enqueue, not the ring's: the events measure that
        with self._lock:
            self._timings.append((start, end))
        return stats

    def _complete(self, fut: torch.futures.Future[Any], tensor: torch.Tensor, event: Any) -> None:
        if event is None:
            fut.set_result(tensor)
            return
        with torch.cuda.device(tensor.device), torch.cuda.stream(self._stream):
            fut.set_result(tensor)  # records an event on the reducer stream for the consumer

    def _serve(self, tensor: torch.Tensor, fut: torch.futures.Future[Any], event: Any) -> None:
        if self._error is not None:
            fut.set_exception(self._error)
            return
        try:
            stats = self._reduce(tensor, event)
        except BaseException as exc:
            self._error = exc
            fut.set_exception(exc)
            return
        with self._lock:
            self._stats += stats
        self._complete(fut, tensor, event)


#: How long interpreter exit (or garbage collection) waits for a reducer's queued work.
_EXIT_JOIN_SECONDS = 10.0


def _serve_reducer(reducer_ref: weakref.ReferenceType[RingBucketReducer], work: _Work) -> None:
    """The reducer thread: a weak reference only, so that a dropped reducer can be collected."""
    while (item := work.get()) is not None:
        reducer = reducer_ref()
        if reducer is None:  # dropped with work queued: fail it rather than leave a waiter hanging
            item[1].set_exception(RuntimeError("RingBucketReducer was dropped before reducing this tensor."))
            continue
        reducer._serve(*item)
        del reducer  # no strong reference while waiting for the next item


def _stop_reducer_thread(work: _Work, thread: threading.Thread, timeout: float) -> bool:
    if thread.is_alive():
        work.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)
    return not thread.is_alive()
