"""CUDA stream order for the parameter servers' tensors, with no Lightning import.

A shard's tensors are touched by many host threads (RPC threads deliver pushes on the streams TensorPipe
received them on; the co-located worker uses the default stream), and a lock orders them on the host only.
:class:`StreamOrder` gives a shard a stream of its own and rules that make the device order follow the
lock's: :meth:`~StreamOrder.take` before the shard uses a caller's tensors, :meth:`~StreamOrder.running` for
its own work (consecutive steps stay ordered whichever thread enqueued them), :meth:`~StreamOrder.reply` /
:meth:`~StreamOrder.give` for what it returns (a *snapshot*, never the live parameters). The worker side
needs nothing: ``rpc_async`` orders its send after the caller's stream, and ``Future.wait`` the caller's
stream after the reply's. On CPU every rule is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch.futures import Future

__all__ = ["CudaStreams", "StreamBackend", "StreamOrder"]

T = TypeVar("T")


class StreamBackend(Protocol):
    """The stream operations :class:`StreamOrder` needs: :class:`CudaStreams`, or a fake in tests (no GPU)."""

    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device``."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """This thread's current stream on ``device``."""
        ...

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        """A context in which ``stream`` is this thread's current stream."""
        ...

    def wait(self, waiter: Any, producer: Any) -> None:
        """Work enqueued on ``waiter`` from now on runs after the work already on ``producer``."""
        ...

    def keep(self, tensor: Tensor, stream: Any) -> None:
        """``tensor``'s memory is not reused before the work enqueued on ``stream`` so far is done."""
        ...

    def future(self, device: torch.device) -> Future[Any]:
        """An empty future that may hold tensors on ``device`` (stream-aware)."""
        ...


class CudaStreams:
    """:class:`StreamBackend` over ``torch.cuda``."""

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def wait(self, waiter: Any, producer: Any) -> None:
        if waiter != producer:
            waiter.wait_stream(producer)  # an event recorded on producer, waited on by waiter: no host sync

    def keep(self, tensor: Tensor, stream: Any) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def future(self, device: torch.device) -> Future[Any]:
        return Future(devices=[device])


class StreamOrder:
    """A shard's stream and the rules that order its device work.

    Args:
        device: where the shard's tensors live.
        backend: the stream operations; default :class:`CudaStreams` for a CUDA ``device`` and
            none (every rule a no-op) otherwise.
    """

    def __init__(self, device: torch.device, backend: StreamBackend | None = None) -> None:
        self.device = device
        if backend is None and device.type == "cuda":
            backend = CudaStreams()
        self.backend = backend
        self.stream: Any = backend.new_stream(device) if backend is not None else None

    @classmethod
    def for_tensors(cls, tensors: Sequence[Tensor], backend: StreamBackend | None = None) -> StreamOrder:
        """The order for a shard holding ``tensors`` (on one device; CPU when there are none)."""
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(
                f"a parameter server shard found tensors on {sorted(map(str, devices))}: expected one device. "
                "Fix: move the whole model to one device before fitting (Lightning does)."
            )
        return cls(devices.pop() if devices else torch.device("cpu"), backend)

    @property
    def active(self) -> bool:
        """Whether there are streams to order (a CUDA device, or a test's backend)."""
        return self.backend is not None

    def take(self, tensors: Iterable[Tensor | None] = ()) -> None:
        """Order the shard stream after the caller's current stream, and keep the caching allocator from
        reusing ``tensors``' memory while the shard's kernels read it.

        Call it on the caller's thread, under the shard's lock, so the waits are enqueued in the lock's order.
        """
        if self.backend is None:
            return
        self.backend.wait(self.stream, self.backend.current_stream(self.device))
        for t in _one_per_storage(tensors):
            self.backend.keep(t, self.stream)

    def running(self) -> AbstractContextManager[Any]:
        """A context in which the shard stream is the current stream."""
        return self.backend.use(self.stream) if self.backend is not None else nullcontext()

    def future(self) -> Future[Any]:
        """An empty reply future (stream-aware on a device)."""
        return self.backend.future(self.device) if self.backend is not None else Future()

    def complete(self, futures: Iterable[Future[Any]], value: Any) -> None:
        """Set ``value`` on ``futures`` with the shard stream current: each records an event there, which
        whoever waits on it (the co-located worker, or TensorPipe before it sends the response) waits on."""
        with self.running():
            for fut in futures:
                fut.set_result(value)

    def reply(self, value: T) -> Future[T]:
        """A future holding ``value``, completed on the shard stream."""
        fut: Future[T] = self.future()
        self.complete([fut], value)
        return fut

    def give(self, tensors: Iterable[Tensor | None] = ()) -> None:
        """Order the caller's current stream after the shard stream and keep ``tensors`` (made on the shard
        stream) alive for it: for a result returned directly, on the caller's thread. An RPC handler's caller
        stream is the one TensorPipe sends the response from, so a plain handler's reply is ordered too."""
        if self.backend is None:
            return
        caller = self.backend.current_stream(self.device)
        self.backend.wait(caller, self.stream)
        for t in _one_per_storage(tensors):
            self.backend.keep(t, caller)


def _one_per_storage(tensors: Iterable[Tensor | None]) -> list[Tensor]:
    """One tensor per distinct storage: the slices of a packed payload share one, and recording
    it once covers them all."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        if t is not None:
            seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())
