"""Per-rank heartbeats in the process group's store, and the diagnosis of a lost peer.

When a peer dies the survivors' errors come from the transport ("Connection closed by peer", "Timed out"),
name no rank, and often come from a neighbour that only stopped because *its* neighbour died. So every rank
keeps a counter in the store every ``torch.distributed`` job has, and a failing rank first marks why: a
survivor's :meth:`Heartbeat.diagnose` tells lost peers (counter still, no mark) from failed ones.
:meth:`Heartbeat.watch` catches what nothing else reports in time: a frozen peer (gloo waits out the
process-group timeout) and, on NCCL, a dead or frozen one (``Work.wait()`` does not raise).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Re-exported: the heartbeat's users import the diagnosis, its errors and the abort from here.
from lightning_strategies.comm.abort import abort_communication, add_abort_hook
from lightning_strategies.comm.peer_lost import (
    PeerDiagnosis,
    PeerLostError,
    annotate_peer_failure,
    failure_reason,
    is_reported,
    raise_peer_lost,
)

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_STORE_CONNECT_TIMEOUT",
    "DEFAULT_STORE_TIMEOUT",
    "DEFAULT_WATCH_GRACE",
    "GRACE_INTERVALS",
    "Heartbeat",
    "PeerDiagnosis",
    "PeerLostError",
    "abort_communication",
    "add_abort_hook",
    "annotate_peer_failure",
    "failure_reason",
    "is_reported",
    "raise_peer_lost",
    "start_heartbeat",
]

log = logging.getLogger(__name__)

#: Seconds between two beats of a rank.
DEFAULT_INTERVAL = 1.0
#: A peer whose counter has not moved for this many intervals (and that said nothing) is lost.
GRACE_INTERVALS = 2.5
# ... plus this many times the diagnosis's slowest poll: a slow store delays both the peers'
# beats and the polls that see them (the rule and its reason: Heartbeat.diagnose).
_GRACE_POLLS = 4.0
#: Timeout of the heartbeat's own store connection: a frozen store host must not freeze a diagnosis.
DEFAULT_STORE_TIMEOUT = timedelta(seconds=5)
#: Timeout of opening that connection: a store whose host is still starting under load can take seconds to
#: accept (5 s fell short with 8 processes starting on 2 cores: the heartbeat of a rank was missing).
DEFAULT_STORE_CONNECT_TIMEOUT = timedelta(seconds=60)
#: Seconds a watched peer may stay silent (or marked failed) before the survivors abort their communication:
#: long enough for a live process whose heartbeat thread waits for the GIL behind a long native call (a large
#: checkpoint write), far below the process groups' 30-minute default timeout.
DEFAULT_WATCH_GRACE = 60.0

_PREFIX = "lightning_strategies/peers"
_FAILED, _FINISHED = 1, 2


class Heartbeat:
    """This rank's heartbeat in a shared store, and the diagnosis of the peers' heartbeats.

    Args:
        store: a store every rank reaches (use :func:`start_heartbeat` for the process group's).
        interval: seconds between beats.
        grace: how long a silent peer is watched before it is called lost; default 2.5 intervals
            (plus 4 times the slowest poll: :meth:`diagnose`).
        store_host: ``"host:port"`` of the store, for messages.
        store_rank: the rank hosting the store (``None``: no rank, e.g. torchrun's agent).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        *,
        interval: float = DEFAULT_INTERVAL,
        grace: float | None = None,
        store_host: str = "",
        store_rank: int | None = 0,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"Heartbeat(interval={interval!r}): expected a positive number of seconds.")
        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank = rank
        self.world = world
        self.interval = float(interval)
        self.grace = float(grace) if grace is not None else GRACE_INTERVALS * self.interval
        self.store_host = store_host
        self.store_rank = store_rank
        self._stop = threading.Event()
        self._marked = False
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._found: PeerDiagnosis | None = None
        self._diagnosing = threading.Lock()  # one diagnosis at a time: the watch's or the failed step's

    @property
    def found(self) -> PeerDiagnosis | None:
        """The diagnosis the watch acted on (it called ``on_lost`` with it), else ``None``."""
        return self._found

    def diagnosis(self) -> PeerDiagnosis:
        """The watch's diagnosis if it found a peer gone (waiting for one in progress), else :meth:`diagnose`
        now: a step the watch's abort failed takes that finding instead of waiting another grace."""
        with self._diagnosing:
            return self._found or self.diagnose()

    def start(self) -> Heartbeat:
        """Clear this rank's mark of an earlier run, beat once, and keep beating on a daemon thread."""
        # The mark is reset, not deleted: a diagnosis reads beat and mark keys with multi_get,
        # which waits for a missing key, so both exist from here on.
        self.store.set(f"mark/{self.rank}", "0")
        self.store.delete_key(f"reason/{self.rank}")
        self.store.add(f"beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception as err:  # the store is gone: a diagnosis will say so; do not spam the log
                log.debug(f"heartbeat of rank {self.rank} stopped: {err}")
                return

    def report_failure(self, reason: str) -> None:
        """Tell the peers this rank stops on an error of its own (once; best effort)."""
        self._mark(_FAILED, reason)

    def stop(self, *, finished: bool = True) -> None:
        """Stop beating and watching; with ``finished`` (and no failure reported) tell the peers it is done.

        The mark comes after the beating thread has ended, so no beat follows it. The rank hosting the store
        (:attr:`store_rank`) then waits up to :attr:`grace` for every peer's mark (finished or failed): its
        process holds the store, and a peer still beating when it exits gets "Connection reset by peer",
        which the store client logs with a C++ stack trace at the end of a run that went well."""
        self._stop.set()
        _RUNNING.discard(self)
        for thread in (self._thread, self._watcher):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.interval + 1.0)
        if finished:
            self._mark(_FINISHED, "finished")
            if self.rank == self.store_rank:
                self._await_peer_marks(self.grace)

    def _await_peer_marks(self, timeout: float) -> None:
        """Return once every peer has marked its end (finished or failed), or after ``timeout`` seconds."""
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [f"beat/{r}" for r in peers] + [f"mark/{r}" for r in peers]
        deadline = time.monotonic() + timeout
        try:
            self._create_absent_keys(peers)
            while not all(self._poll(keys, peers)[1].values()) and time.monotonic() < deadline:
                time.sleep(min(self.interval / 4, max(0.0, deadline - time.monotonic())))
        except Exception as err:  # the store is gone or slow: nothing left to protect
            log.debug(f"rank {self.rank}: stopped waiting for the peers' marks: {err}")

    def watch(
        self,
        on_lost: Callable[[PeerDiagnosis], object],
        *,
        grace: float = DEFAULT_WATCH_GRACE,
        store: dist.Store | None = None,
    ) -> None:
        """Watch the peers while this rank runs, and call ``on_lost`` once if one is found gone.

        Each rank watches its successor (the next that has not finished) and an alarm counter. A peer
        silent, or marked failed, for ``grace`` raises the alarm; an alarm or a store silent for ``grace``
        runs :meth:`diagnose`, and a broken job is kept as :attr:`found` and passed to ``on_lost``. The
        watch ends when this rank fails or finishes, at :meth:`stop`, or after acting.

        Args:
            on_lost: typically :func:`~lightning_strategies.comm.abort.abort_communication`.
            grace: seconds of silence (or of a failed mark) before the alarm; positive.
            store: a connection of its own for the watch (default: the heartbeat's).
        """
        if not grace > 0:
            raise ValueError(f"Heartbeat.watch(grace={grace!r}): expected a positive number of seconds.")
        if self.world < 2:
            return
        watched = dist.PrefixStore(_PREFIX, store) if store is not None else self.store
        self._watcher = threading.Thread(
            target=self._watch, args=(watched, on_lost, float(grace)), name=f"peer-watch-rank{self.rank}", daemon=True
        )
        self._watcher.start()

    def _watch(self, store: dist.Store, on_lost: Callable[[PeerDiagnosis], object], grace: float) -> None:
        try:
            self._watch_loop(store, on_lost, grace)
        except Exception as err:  # the watch must never take the process down; the failure paths still diagnose
            log.warning(f"rank {self.rank}: the peer watch stopped ({type(err).__name__}: {err})")

    def _watch_loop(self, store: dist.Store, on_lost: Callable[[PeerDiagnosis], object], grace: float) -> None:
        # One request per poll, for the watched successor and the alarm: the store's load grows with P, not P^2.
        order = [(self.rank + k) % self.world for k in range(1, self.world)]  # successors, in ring order
        poll = min(self.interval, grace / 4)
        seen = int(store.add("alarm", 0))  # creates the counter: multi_get waits for a missing key
        watched = 0
        _create_keys(store, order[watched])
        beat: int | None = None
        changed = time.monotonic()
        failed_since: float | None = None
        down_since: float | None = None
        while not self._stop.wait(poll):
            if self._marked:  # this rank failed or finished: its own error path reports
                return
            now = time.monotonic()
            target = order[watched]
            try:
                count, mark, alarm = (int(v) for v in store.multi_get([f"beat/{target}", f"mark/{target}", "alarm"]))
                down_since = None
            except Exception:
                down_since = now if down_since is None else down_since
                if now - down_since >= grace and self._act(on_lost):
                    return
                continue
            if alarm != seen:
                seen = alarm
                if self._act(on_lost):
                    return
                beat, changed = None, time.monotonic()  # a false alarm: the watched peer gets its grace again
                continue
            if mark == _FINISHED:
                watched += 1
                if watched == len(order):
                    return  # every peer finished
                _create_keys(store, order[watched])
                beat, changed, failed_since = None, now, None
                continue
            if count != beat:
                beat, changed = count, now
            if mark == _FAILED and failed_since is None:
                failed_since = now
            if now - changed >= grace or (failed_since is not None and now - failed_since >= grace):
                seen = int(store.add("alarm", 1))
                if self._act(on_lost):
                    return
                beat, changed, failed_since = None, time.monotonic(), None

    def _act(self, on_lost: Callable[[PeerDiagnosis], object]) -> bool:
        """Diagnose; if the job is broken, keep the diagnosis and call ``on_lost``. Whether it acted."""
        with self._diagnosing:
            if self._marked or self._stop.is_set():
                return True  # failed, finished or stopped: the rank's own error path diagnoses
            diagnosis = self.diagnose()
            if not diagnosis.broken:
                return False
            self._found = diagnosis  # a failed step waiting for the lock takes this one
        log.error(
            f"rank {self.rank}: aborting communication, a peer is gone:\n"
            f"{diagnosis.describe(f'rank {self.rank}') or diagnosis}"
        )
        on_lost(diagnosis)
        return True

    def _mark(self, code: int, reason: str) -> None:
        if self._marked:
            return
        self._marked = True
        try:
            self.store.set(f"reason/{self.rank}", reason[:500])
            self.store.add(f"mark/{self.rank}", code)  # after the reason: a reader sees both or neither
        except Exception as err:
            log.debug(f"rank {self.rank} could not report to the store: {err}")

    def diagnose(self, grace: float | None = None) -> PeerDiagnosis:
        """Watch the peers' heartbeats for up to ``grace`` seconds and say who is gone; never raises.

        Returns at once for marked peers and as soon as every other counter has moved. A counter still for
        ``grace`` (default :attr:`grace`) plus 4 times the slowest poll ``L`` is lost: a live counter moves
        every ``interval + L``, a poll sees it up to ``max(interval / 4, L) + L`` later, and the first
        snapshot may be ``L`` old: ``1.25 interval + 4 L`` at most.
        """
        grace = self.grace if grace is None else grace
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [f"beat/{r}" for r in peers] + [f"mark/{r}" for r in peers]
        start = time.monotonic()

        def diagnosis(**found: Any) -> PeerDiagnosis:
            waited = time.monotonic() - start
            return PeerDiagnosis(
                self.rank, self.world, store_host=self.store_host, store_rank=self.store_rank, waited=waited, **found
            )

        try:
            self._create_absent_keys(peers)
            poll = time.monotonic()
            first, marks = self._poll(keys, peers)
            slowest = time.monotonic() - poll
            suspects = {r for r in peers if not marks[r]}
            while suspects:
                left = grace + _GRACE_POLLS * slowest - (time.monotonic() - start)
                if left <= 0:
                    break
                time.sleep(min(max(self.interval / 4, slowest), left))
                poll = time.monotonic()
                beats, marks = self._poll(keys, peers)
                slowest = max(slowest, time.monotonic() - poll)
                suspects = {r for r in suspects if beats[r] == first[r] and not marks[r]}
            failed = self._reasons([r for r, m in marks.items() if m == _FAILED])
        except Exception as err:
            return diagnosis(store_error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return diagnosis(
            lost=tuple(sorted(r for r in suspects if not marks[r])),
            failed=failed,
            finished=tuple(sorted(r for r, m in marks.items() if m == _FINISHED)),
        )

    def _poll(self, keys: list[str], peers: list[int]) -> tuple[dict[int, int], dict[int, int]]:
        """The ``peers``' counters and marks, by rank, in one request (``keys``: their beats, then marks)."""
        values = [int(v) for v in self.store.multi_get(keys)]
        n = len(peers)
        return dict(zip(peers, values[:n], strict=True)), dict(zip(peers, values[n:], strict=True))

    def _create_absent_keys(self, peers: list[int]) -> None:
        """Create the beat and mark keys of the ``peers`` that never started their heartbeat, as their start
        would: ``multi_get`` waits for a missing key."""
        for r in self._absent(peers, ("beat", "mark")):
            _create_keys(self.store, r)

    def _absent(self, ranks: list[int], names: tuple[str, ...]) -> list[int]:
        """The ``ranks`` with a key ``<name>/<rank>`` missing from the store, found by bisection:
        one ``check`` when none is missing, about 2 log2(len(ranks)) per rank that is."""
        if not ranks or self.store.check([f"{name}/{r}" for r in ranks for name in names]):
            return []
        if len(ranks) == 1:
            return ranks
        half = len(ranks) // 2
        return self._absent(ranks[:half], names) + self._absent(ranks[half:], names)

    def _reasons(self, ranks: list[int]) -> dict[int, str]:
        """The reasons of the failed ``ranks``, in one request (written before the mark, so present)."""
        ranks = sorted(ranks)
        absent = set(self._absent(ranks, ("reason",)))  # never expected (the reason comes first), but must not stall
        present = [r for r in ranks if r not in absent]
        values = self.store.multi_get([f"reason/{r}" for r in present]) if present else []
        reasons = {r: v.decode(errors="replace") for r, v in zip(present, values, strict=True)}
        return {r: reasons.get(r, "") for r in ranks}


def _create_keys(store: dist.Store, rank: int) -> None:
    """Create ``rank``'s beat and mark keys (0) unless it has started: ``multi_get`` waits for a missing key."""
    store.add(f"beat/{rank}", 0)
    store.add(f"mark/{rank}", 0)


# Heartbeats still beating when the interpreter exits (a run that failed outside Lightning's
# teardown): stopped at exit, since a daemon thread inside a store request delays the exit by seconds.
_RUNNING: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for beat in list(_RUNNING):
        beat.stop(finished=False)


def start_heartbeat(
    rank: int,
    world: int,
    *,
    store_address: tuple[str, int] | None = None,
    interval: float = DEFAULT_INTERVAL,
    store_timeout: timedelta = DEFAULT_STORE_TIMEOUT,
    connect_timeout: timedelta = DEFAULT_STORE_CONNECT_TIMEOUT,
    watch_grace: float | None = None,
    on_lost: Callable[[PeerDiagnosis], object] | None = None,
) -> Heartbeat | None:
    """Start this rank's heartbeat in the process group's ``TCPStore``, and its watch.

    The heartbeat and the watch each open a client connection of their own to the store (within
    ``connect_timeout``), whose requests time out after ``store_timeout``, so they never wait behind the group's
    requests. Their keys lie under ``process_group/attempt_<TORCHELASTIC_RESTART_COUNT>/`` (``attempt_0``
    outside torchrun): torchrun's agent store outlives a restart, which starts afresh.

    Args:
        store_address: ``(host, port)`` of the store the group met in; ``None``: ``MASTER_ADDR`` and
            ``MASTER_PORT``, which Lightning's launchers, torchrun and SLURM set and ``env://`` reads.
        store_timeout: the timeout of the heartbeat's store requests.
        connect_timeout: how long opening each store connection may take.
        watch_grace: seconds of a watched peer's silence before the survivors act; ``None``:
            :data:`DEFAULT_WATCH_GRACE`; ``0``: no watch.
        on_lost: what the watch does; default :func:`~lightning_strategies.comm.abort.abort_communication`.

    Returns:
        The running heartbeat, or ``None`` without a process group, with one rank (``world`` or the default
        group's: strategies whose replicas meet elsewhere keep a group of one), or when the store cannot be
        reached (logged; training is unaffected).
    """
    if world < 2 or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None  # a default group of one rank (ft, local_sgd, diloco, async_elastic) shares no store with peers
    try:
        host, port = store_address or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        prefix = f"process_group/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

        def connection() -> dist.Store:
            client = dist.TCPStore(host, port, is_master=False, timeout=connect_timeout)
            client.set_timeout(store_timeout)
            return dist.PrefixStore(prefix, client)

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        beat = Heartbeat(
            connection(), rank, world, interval=interval, store_host=f"{host}:{port}", store_rank=None if agent else 0
        )
        beat.start()
    except KeyError as err:
        log.warning(
            f"rank {rank}: no heartbeat (no {err} in the environment: pass store_address); "
            "a lost peer will not be named"
        )
        return None
    except Exception as err:
        log.warning(f"rank {rank}: no heartbeat ({err}); a lost peer will not be named")
        return None
    grace = DEFAULT_WATCH_GRACE if watch_grace is None else watch_grace
    if grace:
        try:
            beat.watch(on_lost or abort_communication, grace=grace, store=connection())
        except Exception as err:
            log.warning(f"rank {rank}: no peer watch ({err}); a frozen peer is noticed at the process-group timeout")
    return beat
