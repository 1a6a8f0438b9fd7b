"""What a failure becomes once the heartbeats have been read: the diagnosis, its message, :class:`PeerLostError`.

The Lightning side (a strategy mixin and a callback) is :mod:`lightning_strategies.faults`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "PeerDiagnosis",
    "PeerLostError",
    "annotate_peer_failure",
    "failure_reason",
    "is_reported",
    "raise_peer_lost",
]

_REPORTED = "_lightning_strategies_peer_report"  # set on an exception once it has been diagnosed


class PeerLostError(RuntimeError):
    """A step failed because peers are gone; its message is the diagnosis, the original error its ``__cause__``.

    Attributes:
        ranks: the peers that are gone (lost, failed or finished: :attr:`diagnosis` tells), sorted.
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
        rank: the diagnosing rank, of ``world``.
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

    @property
    def broken(self) -> bool:
        """Whether the job cannot go on: a peer lost or failed, or the store gone (finished peers are not)."""
        return bool(self.lost or self.failed or self.store_error is not None)

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


class _Beat(Protocol):
    """What the failure paths need of a :class:`~lightning_strategies.comm.heartbeat.Heartbeat`
    (a protocol, so that the heartbeat module may import this one and not the other way round)."""

    @property
    def found(self) -> PeerDiagnosis | None: ...

    def report_failure(self, reason: str) -> None: ...

    def diagnosis(self) -> PeerDiagnosis: ...


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


def annotate_peer_failure(exception: BaseException, heartbeat: _Beat | None, strategy: str) -> None:
    """Report this rank's failure, diagnose the peers and add the diagnosis to ``exception`` as a note.

    Once per exception; a no-op without a heartbeat or for a non-``Exception``. Lightning re-raises after
    ``on_exception``, so the note prints with the traceback.
    """
    if heartbeat is None or not isinstance(exception, Exception) or is_reported(exception):
        return
    _set_reported(exception)
    heartbeat.report_failure(failure_reason(exception))
    if isinstance(exception, PeerLostError):
        return  # its message is the diagnosis
    text = heartbeat.diagnosis().describe(strategy)
    if text is not None:
        exception.add_note(text)


@contextmanager
def raise_peer_lost(heartbeat: Callable[[], _Beat | None], strategy: Callable[[], str]) -> Iterator[None]:
    """Turn an error of the block into :class:`PeerLostError` when a peer turns out to be gone.

    Otherwise the error propagates (with the diagnosis as a note when only the store is gone). A block that
    ends without an error after the watch aborted the communication raises too: an aborted NCCL operation
    may return results that must not be used.

    Args:
        heartbeat: returns this rank's heartbeat (or ``None``), read when the block ends.
        strategy: returns the name that starts each line of the diagnosis.
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
        found = beat.found
        # tell the peers first (they may be diagnosing now): the watch's finding when it caused this error
        beat.report_failure(failure_reason(err) if found is None else _lost_reason(found, strategy()))
        diagnosis = beat.diagnosis()
        text = diagnosis.describe(strategy())
        if text is None or not diagnosis.gone:
            if text is not None:  # the store is gone, but no rank can be named
                err.add_note(text)
            raise
        lost = PeerLostError(text, ranks=diagnosis.gone, strategy=strategy(), diagnosis=diagnosis)
        _set_reported(lost)
        raise lost from err
    beat = heartbeat()
    if beat is not None and (found := beat.found) is not None:
        text = found.describe(strategy()) or f"{strategy()}: the peer watch aborted the communication"
        lost = PeerLostError(text, ranks=found.gone, strategy=strategy(), diagnosis=found)
        beat.report_failure(_lost_reason(found, strategy()))
        _set_reported(lost)
        raise lost


def _lost_reason(diagnosis: PeerDiagnosis, strategy: str) -> str:
    """What a rank whose watch aborted its communication tells its peers."""
    text = diagnosis.describe(strategy) or ""
    return f"PeerLostError: {text.splitlines()[0] if text else strategy + ': a peer is gone'}"
