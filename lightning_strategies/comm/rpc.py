"""RPC plumbing shared by the parameter servers (:mod:`.ps`, :mod:`.async_ps`) and the async
coordinator (:mod:`.coordinator`), with no Lightning import.

- Names, rendezvous, start and stop: :func:`worker_name`, :func:`rendezvous_store`,
  :func:`init_rpc`, :func:`shutdown_rpc`. RPC meets in a TCP store of its own (the process
  group's store holds ``MASTER_PORT``), which rank 0 binds on a port the kernel picks *while*
  binding it: no port is chosen first and bound later, so no other socket can take it in between
  (an ephemeral port picked by ``bind(0)`` and released is free for any outgoing connection or
  ``bind(0)`` of another process until RPC binds it again).
- What this process hosts: the shards it serves (``register_shard`` ...) and, on rank 0 of an
  async run, the coordinator (``register_coordinator`` ...). RPC entry points find the object
  they serve here, so they stay plain module-level functions, as RPC requires.
- :func:`call_host`: run an entry point directly when this process hosts its object, else on its
  host over ``rpc_async``; a future either way. A worker thus calls its co-located shard without
  serialisation.
- :class:`ShardError` and :func:`wait_reply`: a failure travels as a value and is raised here.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler
from torch.futures import Future

from lightning_strategies.comm.heartbeat import PeerDiagnosis, add_abort_hook

if TYPE_CHECKING:  # the hosted objects' modules import this one
    from lightning_strategies.comm.coordinator import AsyncCoordinator
    from lightning_strategies.comm.ps import ParameterShard

__all__ = [
    "ShardError",
    "call_host",
    "completed",
    "hosted_coordinator",
    "hosted_shard",
    "init_rpc",
    "is_failure",
    "local_coordinator",
    "local_shard",
    "register_coordinator",
    "register_shard",
    "rendezvous_store",
    "shutdown_rpc",
    "store_url",
    "unregister_coordinator",
    "unregister_shard",
    "wait_reply",
    "worker_name",
]

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Names, ports, start and stop
# --------------------------------------------------------------------------------------------


def worker_name(rank: int) -> str:
    """The RPC name of the training process of global rank ``rank``."""
    return f"ps_worker{rank}"


def rendezvous_store(
    rank: int,
    world_size: int,
    host: str,
    *,
    timeout: timedelta,
    share: Callable[[int], int] | None = None,
) -> dist.TCPStore:
    """The store RPC's processes meet in: rank 0 serves it on a port bound as it is chosen.

    Rank 0's store binds port 0, so the kernel picks a free port and the store holds it from that
    moment; ``share`` hands its number to every rank, and the others connect to ``host`` there.

    Args:
        rank: global rank.
        world_size: number of processes.
        host: rank 0's address as the other ranks reach it (the process group's ``MASTER_ADDR``).
        timeout: how long a rank waits for the store (and the store for its peers).
        share: called by every rank with rank 0's port (0 elsewhere), returns rank 0's port; by
            default a broadcast over the default process group, which must then be initialized.

    Returns:
        The store, for :func:`init_rpc`.
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
_store_keys = itertools.count()


def _store_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    parsed = urlparse(url)
    query = dict(pair.split("=") for pair in parsed.query.split("&") if pair)
    yield _STORES[parsed.netloc], int(query["rank"]), int(query["world_size"])


register_rendezvous_handler(_STORE_SCHEME, _store_rendezvous)


def store_url(store: dist.Store) -> str:
    """An ``init_method`` for ``rpc.TensorPipeRpcBackendOptions`` that meets in ``store`` (kept
    until :func:`shutdown_rpc`)."""
    key = f"s{next(_store_keys)}"
    _STORES[key] = store
    return f"{_STORE_SCHEME}://{key}"


def init_rpc(
    rank: int,
    world_size: int,
    init_method: str | dist.Store,
    *,
    timeout: timedelta,
    num_threads: int = 4,
    device_maps: Mapping[str, Mapping[torch.device, torch.device]] | None = None,
) -> None:
    """Start this process's TensorPipe RPC agent as :func:`worker_name` ``(rank)``.

    Rank and world size are explicit and the rendezvous is ``init_method``, a store of its own
    (:func:`rendezvous_store`), so it does not collide with the process group's store on
    ``MASTER_PORT``.

    Args:
        rank: global rank.
        world_size: number of processes.
        init_method: the store to meet in (:func:`rendezvous_store`), or a URL torch's RPC takes
            (``tcp://host:port``: a port picked beforehand may be taken before it is bound).
        timeout: default timeout of every RPC (and of the rendezvous).
        num_threads: RPC server threads. Handlers never block (async execution), so a few
            suffice; more threads only compete for cores with training.
        device_maps: per peer name, how this process's devices map to the peer's (CUDA only).
    """
    if isinstance(init_method, dist.Store):
        init_method = store_url(init_method)
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_threads,
        rpc_timeout=timeout.total_seconds(),
        init_method=init_method,
    )
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, dict(mapping))  # type: ignore[arg-type]
    with warnings.catch_warnings():
        # torch's own TensorPipe init exchanges device maps through a gloo Backend object and warns
        # that using a Backend as a ProcessGroup is deprecated: nothing a caller can change (torch 2.14)
        warnings.filterwarnings("ignore", message=r".*ProcessGroupGloo.* as a ProcessGroup", category=UserWarning)
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown_rpc(*, failed: bool, timeout: timedelta, grace_seconds: float = 1.0) -> None:
    """Stop this process's RPC agent.

    Args:
        failed: this run failed. A graceful shutdown waits until every process reaches it,
            which dead peers never do; so after a failure the shutdown is local, after a short
            grace that lets replies already queued (such as a shard's error naming the dead
            worker, sent to the survivors) leave before the agent closes its pipes.
        timeout: bound on the graceful shutdown's wait for the peers.
        grace_seconds: the grace before a local shutdown.
    """
    try:
        if failed:
            time.sleep(grace_seconds)
            rpc.shutdown(graceful=False)
            return
        rpc.shutdown(graceful=True, timeout=timeout.total_seconds())
    finally:
        _STORES.clear()  # the rendezvous stores go with the agent (rank 0's closes its port)


# --------------------------------------------------------------------------------------------
# What this process hosts
# --------------------------------------------------------------------------------------------

_SHARDS: dict[int, ParameterShard] = {}
# shards dropped because their host failed, with the error late pushes get: a survivor's push
# that arrives after the drop must name the failure, not suggest disagreeing sharding plans
_STOPPED: dict[int, str] = {}
_COORDINATORS: list[AsyncCoordinator] = []  # at most one, on rank 0 of an async run


def register_shard(shard: ParameterShard) -> None:
    """Make ``shard`` reachable by RPC in this process (one process may host several)."""
    _STOPPED.pop(shard.shard_id, None)
    _SHARDS[shard.shard_id] = shard


def unregister_shard(shard_id: int, *, reason: str | None = None) -> None:
    """Forget the shard (at teardown), so a later fit in this process starts clean.

    Args:
        shard_id: the shard to drop.
        reason: why, when this process failed (the failure's first line): pushes waiting in the
            shard's barrier, and any that arrive until RPC shuts down, get an error carrying it.
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
            f"parameter server shard {shard_id} is not hosted by {rpc.get_worker_info().name} "
            f"(this process hosts {sorted(_SHARDS)}); the sharding plans of the workers disagree"
        )
    return shard


def register_coordinator(coordinator: AsyncCoordinator) -> None:
    """Make ``coordinator`` reachable by RPC in this process (rank 0 hosts it)."""
    _COORDINATORS[:] = [coordinator]


def unregister_coordinator() -> None:
    """Forget this process's coordinator (at teardown)."""
    _COORDINATORS.clear()


def local_coordinator() -> AsyncCoordinator | None:
    """The coordinator when this process hosts it."""
    return _COORDINATORS[0] if _COORDINATORS else None


def hosted_coordinator() -> AsyncCoordinator:
    """The coordinator, which this process must host (RPC entry points call this).

    Raises:
        RuntimeError: when this process does not host it.
    """
    if not _COORDINATORS:
        raise RuntimeError(f"{rpc.get_worker_info().name} hosts no async coordinator; rank 0 should")
    return _COORDINATORS[0]


# --------------------------------------------------------------------------------------------
# Calls and replies
# --------------------------------------------------------------------------------------------


@dataclass
class ShardError:
    """A shard's or the coordinator's refusal (barrier timeout, out-of-step push), sent as a value.

    RPC carries an exception set on an ``async_execution`` future back as a plain value, not
    as an error, so failures travel as this object and :func:`wait_reply` raises them.

    Attributes:
        message: what went wrong, naming the workers involved.
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
    """``entry(*args)`` on rank ``host``: called directly when this process hosts its object.

    Args:
        host: the rank hosting the object ``entry`` serves.
        entry: an RPC entry point of this package: it finds its object with ``hosted_*`` and
            returns a reply (or, under ``@rpc.functions.async_execution``, a future of one).
        *args: its arguments.
        local: this process hosts the object: skip RPC (and serialisation).
        timeout: the RPC timeout in seconds.

    Returns:
        The future of the reply (already done for a direct call that returned a value).
    """
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
