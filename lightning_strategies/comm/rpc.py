"""The one module that names torch RPC: names, rendezvous, start and stop, calls and replies.

A leaf (no Lightning import, none of the objects it carries calls to: the shards and the async
coordinator keep their own registries and module-level entry points), so the transport can change
here alone.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.futures import Future

__all__ = [
    "ShardError",
    "async_execution",
    "call_host",
    "completed",
    "current_name",
    "init_rpc",
    "is_failure",
    "rendezvous_store",
    "shutdown_rpc",
    "store_url",
    "wait_reply",
    "worker_name",
]

T = TypeVar("T")
_TRANSPORTS = ("uv",)
# CPU tensors: cross-memory attach between processes of one host, else the pipe's own connection. Not "mpt_uv",
# which TensorPipe picks between hosts (and between the emulated cluster's nodes): 16 lanes, each a TCP
# connection with a loop thread of its own, so every push wakes many threads (#28).
_CPU_CHANNELS = ("cma", "basic")
F = TypeVar("F", bound=Callable[..., Any])


def worker_name(rank: int) -> str:
    """The RPC name of the training process of global rank ``rank``."""
    return f"ps_worker{rank}"


def current_name() -> str:
    """This process's RPC name (its agent must be running)."""
    return str(rpc.get_worker_info().name)


def rendezvous_store(
    rank: int, world_size: int, host: str, *, timeout: timedelta, share: Callable[[int], int] | None = None
) -> dist.TCPStore:
    """The store RPC's processes meet in (not the process group's, which holds ``MASTER_PORT``).

    Rank 0 binds it on a port the kernel picks *while* binding it: a port picked by ``bind(0)`` and
    released is free for any other socket until it is bound again.

    Args:
        host: rank 0's address as the other ranks reach it (the process group's ``MASTER_ADDR``).
        timeout: how long a rank waits for the store (and the store for its peers).
        share: called by every rank with rank 0's port (0 elsewhere), returns rank 0's port; by
            default a broadcast over the default process group, which must then be initialized.
    """
    store = dist.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
    port = (share or _broadcast_port)(store.port if store is not None else 0)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    return store


def _broadcast_port(port: int) -> int:
    box = [port]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


# torch's RPC takes its rendezvous as a URL: a store made here is handed over through a scheme of
# this module's, by a key naming it in _STORES (kept until shutdown_rpc)
_STORE_SCHEME = "lightning-strategies-store"
_STORES: dict[str, dist.Store] = {}
_MEMBERS: dict[str, tuple[int, int]] = {}  # key -> (this process's rank, world size), from the rendezvous
_store_keys = itertools.count()


def _store_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    parsed = urlparse(url)
    query = dict(pair.split("=") for pair in parsed.query.split("&") if pair)
    _MEMBERS[parsed.netloc] = (int(query["rank"]), int(query["world_size"]))
    yield _STORES[parsed.netloc], int(query["rank"]), int(query["world_size"])


register_rendezvous_handler(_STORE_SCHEME, _store_rendezvous)


def store_url(store: dist.Store) -> str:
    """An ``init_method`` for ``rpc.TensorPipeRpcBackendOptions`` that meets in ``store``."""
    key = f"s{next(_store_keys)}"
    _STORES[key] = store
    return f"{_STORE_SCHEME}://{key}"


def init_rpc(
    rank: int,
    world_size: int | None,
    init_method: str | dist.Store,
    *,
    timeout: timedelta,
    num_threads: int = 4,
    device_maps: Mapping[str, Mapping[torch.device, torch.device]] | None = None,
    name: str | None = None,
) -> None:
    """Start this process's TensorPipe RPC agent as ``name`` (default :func:`worker_name` ``(rank)``).

    Args:
        world_size: ``None`` for torch's dynamic membership (processes join a running group).
        init_method: the store to meet in (:func:`rendezvous_store`), or a URL torch's RPC takes
            (``tcp://host:port``: a port picked beforehand may be taken before it is bound).
        timeout: default timeout of every RPC (and of the rendezvous).
        num_threads: RPC server threads. Handlers never block (async execution), so a few
            suffice; more threads only compete for cores with training.
        device_maps: per peer name, how this process's devices map to the peer's (CUDA only).
    """
    if isinstance(init_method, dist.Store):
        init_method = store_url(init_method)
    # TCP (libuv) only: TensorPipe's shared-memory transport runs a reactor thread that busy-polls: 40-90 ms
    # of CPU per step in each process of the emulated cluster's 4 x 1 ps run at 1gbit (the whole process took
    # 36 ms without it, #28), taken from training where processes share cores. Tensors between processes of
    # one host still take TensorPipe's channels (cross-memory attach where it can), not the transport.
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_threads,
        rpc_timeout=timeout.total_seconds(),
        init_method=init_method,
        _transports=list(_TRANSPORTS),
        # CUDA tensors need TensorPipe's CUDA channels: every registered channel then (their names vary by build)
        _channels=None if device_maps else list(_CPU_CHANNELS),
    )
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, dict(mapping))  # type: ignore[arg-type]
    with warnings.catch_warnings():
        # torch's own TensorPipe init exchanges device maps through a gloo Backend object and warns
        # that using a Backend as a ProcessGroup is deprecated: nothing a caller can change (torch 2.14)
        warnings.filterwarnings("ignore", message=r".*ProcessGroupGloo.* as a ProcessGroup", category=UserWarning)
        rpc.init_rpc(name or worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown_rpc(*, failed: bool, timeout: timedelta, grace_seconds: float = 1.0) -> None:
    """Stop this process's RPC agent.

    Args:
        failed: this run failed: then the shutdown is local (a graceful one waits for every process,
            dead peers too), after ``grace_seconds`` that let queued replies (a shard's error naming
            the dead worker) leave before the agent closes its pipes.
        timeout: bound on the graceful shutdown's wait for the peers.
    """
    try:
        if failed:
            time.sleep(grace_seconds)
            rpc.shutdown(graceful=False)
            return
        rpc.shutdown(graceful=True, timeout=timeout.total_seconds())
        _leave_stores(timeout)
    finally:
        _STORES.clear()  # the rendezvous stores go with the agent (rank 0's closes its port)
        _MEMBERS.clear()


def _leave_stores(timeout: timedelta) -> None:
    # The graceful shutdown ends in a barrier on the store: rank 0 may pass it while a peer still waits for
    # the store's answer, and closing rank 0's store then fails that peer ("Failed to recv"). Each rank says
    # it is done; rank 0 keeps its store until all have (bounded by the timeout).
    deadline = time.monotonic() + timeout.total_seconds()
    for key, store in _STORES.items():
        rank, world = _MEMBERS.get(key, (0, 1))
        done = store.add("lightning_strategies/rpc_shutdown_done", 1)
        while rank == 0 and done < world and time.monotonic() < deadline:
            time.sleep(0.01)
            done = store.add("lightning_strategies/rpc_shutdown_done", 0)


# -- calls and replies -------------------------------------------------------------------------


def async_execution(entry: F) -> F:
    """Mark an RPC entry point that returns a future at once: its RPC thread is free while the
    reply waits (a barrier, a held refill), so a handful of threads serve any number of callers."""
    return rpc.functions.async_execution(entry)


@dataclass
class ShardError:
    """A shard's or the coordinator's refusal (barrier timeout, out-of-step push), sent as a value:
    RPC returns an exception set on an ``async_execution`` future as a plain value, so failures travel
    as this object and :func:`wait_reply` raises them.

    Attributes:
        timed_out: the barrier (or the staleness gate) timed out waiting for a worker.
    """

    message: str
    timed_out: bool = False


def completed(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def call_host(host: int, entry: Callable[..., Any], *args: Any, local: bool, timeout: float) -> Future[Any]:
    """``entry(*args)`` on rank ``host``, called directly (no serialisation) when ``local`` (this process
    hosts the object); a future of its reply. ``entry`` is a module-level RPC entry point: it finds
    its object in its module's registry. ``timeout`` is in seconds."""
    if local:
        reply = entry(*args)
        return reply if isinstance(reply, Future) else completed(reply)
    return rpc.rpc_async(worker_name(host), entry, args=args, timeout=timeout)


def is_failure(fut: Future[Any]) -> bool:
    """Whether the finished ``fut`` raised or holds a :class:`ShardError`."""
    try:
        return isinstance(fut.value(), ShardError)
    except Exception:
        return True


def wait_reply(fut: Future[Any], where: str) -> Any:
    """The reply ``fut`` holds, waiting for it; a failure is raised with ``where`` in front.

    Raises:
        TimeoutError: the reply is a :class:`ShardError` of a timeout.
        RuntimeError: the RPC failed, or the reply is any other :class:`ShardError`.
    """
    try:
        reply = fut.wait()
    except Exception as err:
        raise RuntimeError(f"{where}: {err}") from err
    if isinstance(reply, ShardError):
        raise (TimeoutError if reply.timed_out else RuntimeError)(f"{where}: {reply.message}")
    return reply
