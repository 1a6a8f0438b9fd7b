"""Per-rank heartbeats in the process group's store, and the diagnosis of a lost peer.

When a peer dies, the survivors' errors come from the transport: gloo says "Connection closed
by peer [10.0.0.7]:41877", TensorPipe "pipe closed", NCCL "remote process exited", or, for a
peer that froze, "Timed out" after the process-group timeout. None of them names a *rank*, and
in a ring or a pipeline the failing connection is often to a neighbour that only stopped
because *its* neighbour died first. Which rank was lost is a question for a third party, so
every rank keeps a heartbeat in the process group's store (the ``TCPStore`` every
``torch.distributed`` job already has, hosted by rank 0 or by torchrun's agent):

- a daemon thread adds 1 to ``beat/<rank>`` every ``interval`` seconds, through a connection of
  its own with a short timeout (:class:`Heartbeat`);
- a rank that fails writes ``mark/<rank>`` (failed, with the first line of its error) before
  anything else, and a rank that finishes writes "finished";
- a survivor diagnoses (:meth:`Heartbeat.diagnose`): peers whose counter moves are alive; peers
  whose counter stays still for ``grace`` (2.5 intervals, longer when the store is slow to
  answer) and that wrote no mark are *lost* (killed, crashed hard, or frozen); peers with a mark
  stopped on an error of their own, and the mark says which. When the store itself no longer
  answers, its host is named (rank 0, unless torchrun's agent hosts it).

The diagnosis runs only on failure and takes at most ``grace`` seconds, plus 4 polls when the
store is slow (about one ``interval`` when every peer is alive); each of its polls reads every
peer's counter and mark in one store request (``multi_get``), so hundreds of survivors
diagnosing at once cost the store one request each per poll, not one per peer. The heartbeat
costs one small store request per rank per ``interval``. :func:`raise_peer_lost` turns the error
of a failed step into :class:`PeerLostError` when a peer is gone, and
:func:`annotate_peer_failure` adds the diagnosis to any other error as a note. The Lightning
side (a strategy mixin and a callback) is :mod:`lightning_strategies.faults`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_STORE_TIMEOUT",
    "GRACE_INTERVALS",
    "Heartbeat",
    "PeerDiagnosis",
    "PeerLostError",
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

_PREFIX = "lightning_strategies/peers"
_FAILED, _FINISHED = 1, 2
_REPORTED = "_lightning_strategies_peer_report"  # set on an exception once it has been diagnosed


class PeerLostError(RuntimeError):
    """A step failed because one or more peers are gone.

    Raised by :func:`raise_peer_lost`, around the step hooks of this package's strategies (the
    original error is its ``__cause__``). Its message is the diagnosis, e.g. ``"ring: lost peer rank 1 of 2: no
    heartbeat for 2.5 s and no error reported ..."``.

    Attributes:
        ranks: the peers that are gone: lost without a word, stopped on an error of their own,
            or already finished (:attr:`diagnosis` tells which is which), sorted.
        strategy: the strategy's name (``"ring"``, ``"parameter_server"``, ``"ddp"``, ...).
        diagnosis: the full diagnosis.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...], strategy: str, diagnosis: PeerDiagnosis) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.strategy = strategy
        self.diagnosis = diagnosis


@dataclass(frozen=True)
class PeerDiagnosis:
    """What a rank found out about its peers after a failure.

    Attributes:
        rank: the diagnosing rank.
        world: the number of ranks.
        lost: peers whose heartbeat stopped without a mark (killed, crashed hard, frozen).
        failed: peers that reported an error of their own, with its first line.
        finished: peers that had finished (left before this rank failed).
        store_error: the error of the store when it could not be read, else ``None``.
        store_host: ``"host:port"`` of the store (``""`` when it is not a TCP store).
        store_rank: the rank hosting the store (``None`` when torchrun's agent hosts it).
        waited: seconds the diagnosis watched the counters.
    """

    rank: int
    world: int
    lost: tuple[int, ...] = ()
    failed: dict[int, str] = field(default_factory=dict)
    finished: tuple[int, ...] = ()
    store_error: str | None = None
    store_host: str = ""
    store_rank: int | None = 0
    waited: float = 0.0

    @property
    def gone(self) -> tuple[int, ...]:
        """Every peer known to be gone, the store's host rank included when the store is lost."""
        ranks = set(self.lost) | set(self.failed) | set(self.finished)
        if self.store_error is not None and self.store_rank is not None and self.store_rank != self.rank:
            ranks.add(self.store_rank)
        return tuple(sorted(ranks))

    def describe(self, strategy: str) -> str | None:
        """The diagnosis as lines starting with ``"<strategy>: "``, or ``None`` when every peer is alive."""
        lines = []
        if self.store_error is not None:
            where = f"the store at {self.store_host}" if self.store_host else "the store"
            if self.store_rank is not None and self.store_rank != self.rank:
                lines.append(
                    f"{strategy}: lost peer rank {self.store_rank} of {self.world}: it hosts {where}, which no longer "
                    f"answers ({self.store_error}); rank {self.store_rank} died or its host is unreachable"
                )
            else:
                host = "torchrun's agent on node 0" if self.store_rank is None else "this rank"
                lines.append(
                    f"{strategy}: {where} (hosted by {host}) no longer answers ({self.store_error}), so no peer "
                    "could be named: the job's launcher or its node is gone"
                )
        if self.lost:
            ranks = ", ".join(map(str, self.lost))
            lines.append(
                f"{strategy}: lost peer rank{'s' if len(self.lost) > 1 else ''} {ranks} of {self.world}: no heartbeat "
                f"for {self.waited:.1f} s and no error reported, so it was killed (OOM killer, preemption, SIGKILL), "
                f"crashed hard or froze; check its node and logs. The error above is how rank {self.rank} noticed"
            )
        for r, reason in sorted(self.failed.items()):
            lines.append(f"{strategy}: peer rank {r} of {self.world} stopped on an error: {reason}")
        if self.finished:
            ranks = ", ".join(map(str, self.finished))
            lines.append(f"{strategy}: peer rank(s) {ranks} of {self.world} had already finished and left")
        return "\n".join(lines) if lines else None


class Heartbeat:
    """This rank's heartbeat in a shared store, and the diagnosis of the peers' heartbeats.

    Args:
        store: a store every rank reaches (use :func:`start_heartbeat` for the process group's);
            the heartbeat's keys live under a prefix of their own.
        rank: this rank.
        world: the number of ranks.
        interval: seconds between beats.
        grace: how long a silent peer is watched before it is called lost; default 2.5 intervals
            (plus 4 times the slowest poll of the store: :meth:`diagnose`).
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
        """Stop beating; with ``finished`` (and no failure reported) tell the peers this rank is done."""
        if finished:
            self._mark(_FINISHED, "finished")
        self._stop.set()
        _RUNNING.discard(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)

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
        """Watch the peers' heartbeats for up to ``grace`` seconds and say who is gone.

        Returns at once for peers with a mark, and as soon as every other peer's counter has
        moved; a peer whose counter stays still for ``grace`` seconds (default :attr:`grace`)
        plus 4 times the slowest poll is lost. Never raises: an unreachable store is part of
        the diagnosis.

        Each poll reads every peer's counter and mark in one ``multi_get``. The grace grows
        with the poll time because a slow store (many ranks diagnosing at once, a loaded host)
        slows everything the diagnosis watches: with polls of ``L`` seconds, a live peer's
        counter moves at least every ``interval + L`` (its beat queues in the store too), a
        poll sees the move at most one poll period (``max(interval / 4, L) + L``) later, and
        the first snapshot may be ``L`` old: at most ``1.25 interval + 4 L`` in all. ``grace``
        covers the first term with a margin (2.5 intervals by default) and ``4 L`` the rest; on
        a responsive store ``L`` is well under a millisecond and the grace is ``grace``. Polls
        are spaced by the poll time at least, so a slow store is not polled harder.
        """
        grace = self.grace if grace is None else grace
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [f"beat/{r}" for r in peers] + [f"mark/{r}" for r in peers]
        start = time.monotonic()
        try:
            for r in self._absent(peers, ("beat", "mark")):  # a peer that never started its heartbeat
                self.store.add(f"beat/{r}", 0)  # creates the keys (0), as its start would: multi_get waits for none
                self.store.add(f"mark/{r}", 0)
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
            return PeerDiagnosis(
                self.rank,
                self.world,
                store_error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                store_host=self.store_host,
                store_rank=self.store_rank,
                waited=time.monotonic() - start,
            )
        return PeerDiagnosis(
            self.rank,
            self.world,
            lost=tuple(sorted(r for r in suspects if not marks[r])),
            failed=failed,
            finished=tuple(sorted(r for r, m in marks.items() if m == _FINISHED)),
            store_host=self.store_host,
            store_rank=self.store_rank,
            waited=time.monotonic() - start,
        )

    def _poll(self, keys: list[str], peers: list[int]) -> tuple[dict[int, int], dict[int, int]]:
        """The ``peers``' counters and marks, by rank, in one request (``keys``: their beats, then marks)."""
        values = [int(v) for v in self.store.multi_get(keys)]
        n = len(peers)
        return dict(zip(peers, values[:n], strict=True)), dict(zip(peers, values[n:], strict=True))

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
    interval: float = DEFAULT_INTERVAL,
    store_timeout: timedelta = DEFAULT_STORE_TIMEOUT,
) -> Heartbeat | None:
    """Start this rank's heartbeat in the default process group's store.

    The heartbeat gets a connection of its own (a clone of the ``TCPStore`` client, with
    ``store_timeout``), so it never waits behind the process group's own store requests and a
    frozen store host stalls a diagnosis for at most ``store_timeout``. Its keys sit under the
    group's prefixes, so a torchrun restart (a new prefix per attempt) starts afresh.

    Returns:
        The running heartbeat, or ``None`` without an initialised process group, with one rank,
        or when the store cannot be reached (a warning is logged; training is unaffected).
    """
    if world < 2 or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        base = getattr(store, "_underlying_non_prefix_store", store)  # below the PrefixStores
        host = f"{base.host}:{base.port}" if isinstance(base, dist.TCPStore) else ""
        if isinstance(base, dist.TCPStore):
            store = store.clone()  # a connection of its own, under the same prefixes
            store.set_timeout(store_timeout)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        beat = Heartbeat(store, rank, world, interval=interval, store_host=host, store_rank=None if agent else 0)
        return beat.start()
    except Exception as err:
        log.warning(f"rank {rank}: no heartbeat ({err}); a lost peer will not be named")
        return None


def failure_reason(exception: BaseException) -> str:
    """What a failed rank tells its peers: the exception's type and the first line of its message."""
    text = str(exception).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exception).__name__}: {first}"


def is_reported(exception: BaseException) -> bool:
    """Whether ``exception`` was already diagnosed (by :func:`annotate_peer_failure` or :func:`raise_peer_lost`)."""
    return bool(getattr(exception, _REPORTED, False))


def _set_reported(exception: BaseException) -> None:
    with contextlib.suppress(AttributeError):  # an exception type with __slots__: diagnosed twice
        setattr(exception, _REPORTED, True)


def annotate_peer_failure(exception: BaseException, heartbeat: Heartbeat | None, strategy: str) -> None:
    """Report this rank's failure, diagnose the peers and add the diagnosis to ``exception`` as a note.

    Idempotent (a second call on the same exception does nothing) and a no-op without a
    heartbeat or for a ``KeyboardInterrupt``-like ``BaseException``. Lightning re-raises the
    exception after ``Callback.on_exception`` / ``Strategy.on_exception``, so the note is
    printed with its traceback.
    """
    if heartbeat is None or not isinstance(exception, Exception) or is_reported(exception):
        return
    _set_reported(exception)
    heartbeat.report_failure(failure_reason(exception))
    if isinstance(exception, PeerLostError):
        return  # its message is the diagnosis
    text = heartbeat.diagnose().describe(strategy)
    if text is not None:
        exception.add_note(text)


@contextmanager
def raise_peer_lost(heartbeat: Callable[[], Heartbeat | None], strategy: Callable[[], str]) -> Iterator[None]:
    """Turn an error of the block into :class:`PeerLostError` when a peer turns out to be gone.

    On an error this rank reports its failure, diagnoses the peers and raises
    :class:`PeerLostError` (the error as its ``__cause__``) when the diagnosis names a gone peer;
    otherwise the error propagates unchanged (with the diagnosis as a note when only the store
    is gone). An error already diagnosed, or a block run without a heartbeat, is left alone.

    Args:
        heartbeat: returns this rank's heartbeat (or ``None``), read only when the block fails.
        strategy: returns the name that starts each line of the diagnosis (``"ring"``, ``"ddp"``).
    """
    try:
        yield
    except PeerLostError:
        raise
    except Exception as err:
        beat = heartbeat()
        if beat is None or is_reported(err):
            raise
        _set_reported(err)
        beat.report_failure(failure_reason(err))
        diagnosis = beat.diagnose()
        text = diagnosis.describe(strategy())
        if text is None or not diagnosis.gone:
            if text is not None:  # the store is gone, but no rank can be named
                err.add_note(text)
            raise
        lost = PeerLostError(text, ranks=diagnosis.gone, strategy=strategy(), diagnosis=diagnosis)
        _set_reported(lost)
        raise lost from err
