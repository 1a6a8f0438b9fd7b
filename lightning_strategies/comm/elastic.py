"""Membership for asynchronous training with dedicated servers (no Lightning import), used by
:class:`~lightning_strategies.AsyncElasticStrategy`.

- **The store.** The job's ``MASTER_ADDR:MASTER_PORT`` TCP store, served by rank 0 (the chief) or by
  torchrun's agent: the rendezvous of every process, a relaunched one too.
- **Incarnations.** Each start of a rank takes the next number and joins RPC under a name and an id of
  its own (:func:`member_name`, :func:`member_id`), so nothing is confused with the dead process.
- **Dynamic RPC.** torch's TensorPipe agent without a world size lets processes join a running group.
  It does not forget a member that died without leaving, and the next join asks it too and fails:
  :func:`evict` removes a dead member the way its leave would have (the only use of torch internals).
- **Detection.** :class:`MembershipMonitor` on the chief drops a lost worker; a lost server fails the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_strategies.comm.heartbeat import _FAILED, DEFAULT_INTERVAL, GRACE_INTERVALS, Heartbeat, _create_keys
from lightning_strategies.comm.ps import Packed, hosted_shard
from lightning_strategies.comm.rpc import init_rpc, worker_name

__all__ = [
    "MembershipMonitor",
    "connect_store",
    "evict",
    "init_member_rpc",
    "load_server_values",
    "mark_evicted",
    "member_id",
    "member_name",
    "next_incarnation",
    "remove_from_torch_rpc_group",
    "run_prefix",
]

log = logging.getLogger(__name__)

_PREFIX = "lightning_strategies/elastic"
_TOKEN = "RpcGroupManagementToken"  # torch.distributed.rpc._utils._group_membership_management's key
_MAX_ID = 2**15 - 1  # TensorPipe worker ids are int16


def run_prefix() -> str:
    """This run's namespace in the job's store: one per torchrun attempt (the agent's store outlives them)."""
    return f"{_PREFIX}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def connect_store(host: str, port: int, rank: int, *, timeout: timedelta) -> tuple[dist.Store, dist.TCPStore]:
    """``(this run's namespace, the TCP store underneath)`` of the job's store."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    serve = rank == 0 and not agent
    base = dist.TCPStore(host, port, is_master=serve, wait_for_workers=False, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(run_prefix(), base), base


def next_incarnation(store: dist.Store, rank: int) -> int:
    """This start's incarnation of ``rank``: 0 the first time, then 1, 2, ..."""
    return int(store.add(f"incarnation/{rank}", 1)) - 1


def member_name(rank: int, incarnation: int) -> str:
    """The RPC name of ``rank``'s ``incarnation`` (the static name for the first)."""
    return worker_name(rank) if incarnation == 0 else f"{worker_name(rank)}_{incarnation}"


def member_id(rank: int, incarnation: int, world_size: int) -> int:
    """The RPC id of ``rank``'s ``incarnation``, unique within the run; ValueError past TensorPipe's int16."""
    value = rank + incarnation * world_size
    if value > _MAX_ID:
        raise ValueError(
            f"rank {rank} restarted {incarnation} times in a world of {world_size}: its RPC id {value} is past "
            f"TensorPipe's {_MAX_ID}. Expected fewer restarts per run. Fix: restart the whole run from its "
            "last checkpoint."
        )
    return value


def init_member_rpc(
    store: dist.Store,
    connect: Callable[[], dist.Store],
    rank: int,
    incarnation: int,
    world_size: int,
    *,
    timeout: timedelta,
    num_threads: int = 4,
    device_maps: Mapping[str, Mapping[torch.device, torch.device]] | None = None,
    join_timeout: float = 30.0,
) -> str:
    """Join (or found, for the first member) the run's dynamic RPC group; returns this member's name.

    A relaunched worker first waits until its rank's last incarnation has been evicted; the run's first
    members join in rank order. One attempt per process (torch names the group's store after a
    per-process count of inits, which every member must share): a failed join cleans up and raises
    ``RuntimeError`` (naming the cause and the fix), and the process is started again as a fresh incarnation.

    Args:
        store: the run's namespace in the job's store (this process's connection).
        connect: a new connection to the same namespace (torch sets the RPC store's timeout to
            the RPC timeout, and a store wait that timed out leaves its connection unusable).
        join_timeout: the agent's default RPC timeout, bounding the join's calls (a frozen member
            still listed fails it after that long; a loaded machine needs more than a few seconds).
    """
    name = member_name(rank, incarnation)
    rpc_id = member_id(rank, incarnation, world_size)
    # a lost incarnation is dropped after the grace (killed) or the timeout (frozen), then evicted
    _wait_evicted(store, rank, incarnation, timeout + timedelta(minutes=1))
    if incarnation == 0:
        # each join asks every member before it, and joins that contend for the membership token
        # on a loaded machine time out one another
        earlier = [f"rpc_joined/{k}/0" for k in range(rank)]
        if earlier:
            store.wait(earlier, max(timeout, timedelta(minutes=5)))
    try:
        init_rpc(rpc_id, None, dist.PrefixStore("rpc", connect()), timeout=timedelta(seconds=join_timeout),
                 num_threads=num_threads, device_maps=device_maps, name=name)  # fmt: skip
    except Exception as err:
        remove_from_torch_rpc_group(dist.PrefixStore("rpc", connect()), name, rpc_id, me=None)
        cause = err.__context__ or err  # torch's clean-up error hides the join's own
        raise RuntimeError(
            f"{name}: found the RPC group refusing the join ({str(cause).splitlines()[0]}): expected every "
            "listed member alive or evicted. Fix: start the worker again (a new incarnation); if it keeps "
            "failing, restart the run from its last checkpoint."
        ) from err
    store.set(f"rpc_joined/{rank}/{incarnation}", name)
    return name


def _wait_evicted(store: dist.Store, rank: int, incarnation: int, timeout: timedelta) -> None:
    """Wait until the last incarnation of ``rank`` that joined the RPC group has been evicted."""
    earlier = [k for k in range(incarnation) if store.check([f"rpc_joined/{rank}/{k}"])]
    if not earlier:
        return
    try:
        store.wait([f"evicted/{rank}/{earlier[-1]}"], timeout)
    except Exception as err:
        raise RuntimeError(
            f"rank {rank} (incarnation {incarnation}): its incarnation {earlier[-1]} is still a member of the run "
            f"after {timeout.total_seconds():.0f}s ({err}). Expected it lost (its heartbeat stopped) and dropped by "
            "the chief first. Fix: end the old process before starting its rank again."
        ) from err


def mark_evicted(store: dist.Store, rank: int, incarnation: int) -> None:
    """Tell a relaunch of ``rank`` that its ``incarnation`` is out of the RPC group."""
    store.set(f"evicted/{rank}/{incarnation}", "1")


def evict(name: str, rpc_store: dist.Store, *, timeout: float = 5.0) -> bool:
    """Remove the member ``name`` (a dead process) from the RPC group, as its leave would have; runs on
    a live member (the chief), ``rpc_store`` a new connection to the group's store. Returns whether
    ``name`` was known."""
    try:
        info = rpc.get_worker_info(name)
        me = rpc.get_worker_info().name
    except Exception:
        return False
    remove_from_torch_rpc_group(rpc_store, info.name, info.id, me=me, timeout=timeout)
    return True


def remove_from_torch_rpc_group(
    rpc_store: dist.Store, name: str, rpc_id: int, *, me: str | None, timeout: float = 5.0
) -> None:
    """The one function of the package that uses torch RPC internals (torch 2.14).

    There is no public way to remove a member that died (or whose join failed), so this does what
    torch's own leave does, under the same membership token: ``name`` comes off the group's list
    (``names/_ALL_WORKER_INFOS`` in the ``rpc_prefix_0`` namespace of a process's first init) and, with
    ``me`` (a live member), off every live agent's tables (``_update_group_membership``). Without ``me``
    (a failed join cleaning up) the join's token is released; unlike torch's leave, the token is
    released even when a member does not answer. ``tests/unit/test_torch_rpc_internals.py`` fails when
    torch changes any of these.
    """
    # the internal, imported here only, so that no other function of the package can reach it
    from torch.distributed.rpc._utils import _update_group_membership

    store = dist.PrefixStore("rpc_prefix_0", rpc_store)
    token = f"Token_for_{me}_evict_{name}" if me is not None else f"Token_for_{name}_join"
    deadline = time.monotonic() + timeout
    while me is not None:  # torch's membership critical section, with a release that always happens
        holder = store.compare_set(_TOKEN, "", token).decode()
        if holder == token:
            break
        if time.monotonic() > deadline:
            log.warning(f"evicting {name}: the RPC membership token stayed with {holder!r}; evicting without it")
            break
        time.sleep(0.05)
    try:
        names = dist.PrefixStore("names", store)
        listed = names.get("_ALL_WORKER_INFOS").decode()
        names.set("_ALL_WORKER_INFOS", listed.replace(f"{name}-{rpc_id},", ""))
        if me is not None:
            info = rpc.get_worker_info(name)
            _update_group_membership(info, [], {}, False)
            others = {entry.rsplit("-", 1)[0] for entry in listed.split(",") if entry} - {me, name}
            futures: list[Any] = []
            update: tuple[Any, ...] = (info, [], {}, False)
            for w in others:
                with contextlib.suppress(Exception):  # listed by a join that failed before telling anyone
                    futures.append(rpc.rpc_async(w, _update_group_membership, args=update, timeout=timeout))
            for fut in futures:
                with contextlib.suppress(Exception):  # a member that does not answer is evicted in turn
                    fut.wait()
    except Exception as err:
        if me is not None:
            raise
        log.debug(f"{name}: cleaning up a failed join: {err}")
    finally:
        with contextlib.suppress(Exception):  # released as torch does: waiters wait for a key named after it
            store.compare_set(_TOKEN, token, "")
            store.set(token, "Done")


def _rpc_ping() -> bool:
    return True


class MembershipMonitor:
    """Watch the members' heartbeats on the chief; drop lost workers, fail on a lost server.

    One store request per interval reads every heartbeat. A member that reported a failure is dropped
    at once; one silent for ``grace`` is pinged over RPC: a dead process refuses (dropped), a frozen
    one is dropped once silent for ``timeout``.

    Args:
        heartbeat: the chief's own heartbeat (its store is the one every member beats in).
        workers: the worker ranks; ``servers``: the server ranks other than the chief.
        name_of: the current RPC name of a rank; ``alive``: the worker ranks alive now.
        joined: whether a worker's current incarnation has joined (it is watched from then on, and
            dropped if it has not joined ``timeout`` after the monitor started).
        drop: ``drop(rank, reason)`` for a lost worker; ``fail(rank, reason)``, once, for a lost server.
        timeout: a silent member that still holds its connections (frozen) is dropped after this long.
        interval: seconds between two reads of the heartbeats; ``grace``: of silence before a ping.
    """

    def __init__(
        self,
        heartbeat: Heartbeat,
        *,
        workers: Sequence[int],
        servers: Sequence[int],
        name_of: Callable[[int], str],
        alive: Callable[[], Sequence[int]],
        joined: Callable[[int], bool],
        drop: Callable[[int, str], object],
        fail: Callable[[int, str], None],
        timeout: timedelta,
        interval: float = DEFAULT_INTERVAL,
        grace: float | None = None,
    ) -> None:
        self.heartbeat = heartbeat
        self.workers = list(workers)
        self.servers = list(servers)
        self._name_of = name_of
        self._alive = alive
        self._joined = joined
        self._drop = drop
        self._fail = fail
        self.timeout = timeout.total_seconds()
        self.interval = interval
        self.grace = grace if grace is not None else GRACE_INTERVALS * interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last moved)
        self._pings: dict[int, tuple[Any, str]] = {}  # rank -> (future, the name pinged)
        self._failed = False
        self._created: set[int] = set()
        #: (rank, what, seconds since start): "dropped: <reason>" and the like, for logs and tests
        self.events: list[tuple[int, str, float]] = []
        self._start = time.monotonic()

    def start(self) -> MembershipMonitor:
        self._thread = threading.Thread(target=self._run, name="async-membership", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._poll()
            except Exception as err:  # the store is gone (the chief is exiting): nothing to watch
                log.debug(f"membership monitor stopped: {err}")
                return

    def _poll(self) -> None:
        alive = set(self._alive())
        now = time.monotonic()
        waiting = [r for r in self.workers if r in alive and not self._joined(r)]
        if now - self._start > self.timeout:
            for rank in waiting:  # started with the run but never joined it
                self._lost(rank, f"it did not join the run within the timeout ({self.timeout:.0f} s)")
        ranks = [r for r in self.workers if r in alive and r not in waiting] + ([] if self._failed else self.servers)
        if not ranks:
            return
        store = self.heartbeat.store
        for rank in ranks:
            if rank not in self._created:  # multi_get waits for a missing key: create both first
                _create_keys(store, rank)
                self._created.add(rank)
        values = store.multi_get([f"beat/{r}" for r in ranks] + [f"mark/{r}" for r in ranks])
        now = time.monotonic()
        for i, rank in enumerate(ranks):
            beat, mark = int(values[i]), int(values[len(ranks) + i])
            before = self._seen.get(rank)
            if before is None or before[0] != beat:
                self._seen[rank] = (beat, now)
                self._pings.pop(rank, None)
            if mark == _FAILED:
                reason = store.get(f"reason/{rank}").decode(errors="replace") if store.check([f"reason/{rank}"]) else ""
                self._lost(rank, f"it reported a failure ({reason})")
                continue
            silent = now - self._seen[rank][1]
            if silent > self.grace:
                self._check(rank, silent)

    def _check(self, rank: int, silent: float) -> None:
        pending = self._pings.get(rank)
        if pending is None:
            name = self._name_of(rank)
            try:
                fut = rpc.rpc_async(name, _rpc_ping, timeout=max(1.0, self.timeout - silent))
            except Exception as err:  # unknown to RPC: it never joined, or left
                self._lost(rank, f"no heartbeat for {silent:.1f} s and not reachable over RPC ({err})")
                return
            self._pings[rank] = (fut, name)
            return
        fut, name = pending
        if not fut.done():
            return
        try:
            fut.wait()
        except Exception as err:
            text = str(err).splitlines()[0] if str(err) else type(err).__name__
            frozen = "timed out" in text.lower() or "timeout" in text.lower()
            how = (
                f"frozen: no heartbeat for {silent:.1f} s and no answer within the timeout ({self.timeout:.0f} s)"
                if frozen
                else f"killed: no heartbeat for {silent:.1f} s and its RPC connection is gone ({text})"
            )
            self._lost(rank, how)
            return
        # it answered: alive (busy, or its heartbeat thread starved); ping again after another grace
        self._pings.pop(rank, None)
        self._seen[rank] = (self._seen[rank][0], time.monotonic())

    def _lost(self, rank: int, reason: str) -> None:
        self.forget(rank)
        self.events.append((rank, reason, time.monotonic() - self._start))
        if rank in self.servers:
            if not self._failed:
                self._failed = True
                self._fail(rank, reason)
            return
        self._drop(rank, reason)

    def forget(self, rank: int) -> None:
        """A new incarnation of ``rank`` joined: its heartbeat is watched afresh."""
        self._seen.pop(rank, None)
        self._pings.pop(rank, None)


def _rpc_load_values(shard_id: int, values: Packed) -> None:
    shard = hosted_shard(shard_id)
    unpacked = shard.unpack(values)
    shard.load_values([v for v in unpacked if v is not None])


def load_server_values(shard_id: int, host: str, values: Packed, *, timeout: float) -> Any:
    """Send ``values`` to shard ``shard_id`` on the member ``host``; returns the RPC future."""
    return rpc.rpc_async(host, _rpc_load_values, args=(shard_id, values), timeout=timeout)
