"""Who is in an async run: a fixed set of workers, or a changing one (workers join and are dropped).

Both log joins, drops and leaves with each rank's *incarnation* (a relaunched worker takes its old
rank's slot with a new one).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import MutableMapping
from typing import Protocol

from lightning_strategies.comm.async_.clocks import SSPClocks
from lightning_strategies.comm.async_.held import HeldRequests, Ready
from lightning_strategies.comm.async_.messages import RECORD_LIMIT, DataPlan
from lightning_strategies.comm.async_.queue import BatchQueue, Epoch
from lightning_strategies.comm.async_.workers import Held, WorkerState
from lightning_strategies.comm.rpc import ShardError

__all__ = ["ChangingMembership", "FixedMembership", "Membership", "Ready", "Run"]


class Run(Protocol):
    """What a membership may do to the run it belongs to (the coordinator)."""

    def abort(self, reason: str) -> None: ...

    def drop(self, worker: int, reason: str, *, incarnation: int | None = None) -> bool: ...

    def set_failure(self, message: str) -> None: ...

    def take_held(self) -> list[Held]: ...


class Membership(ABC):
    """The workers' records and the log of joins, drops and leaves (the coordinator's lock guards it);
    ``workers`` is shared with the coordinator's other parts."""

    #: a held request waits this many times the coordinator's ``timeout`` before it fails
    patience = 1.0

    def __init__(self, workers: MutableMapping[int, WorkerState], queue: BatchQueue, clocks: SSPClocks) -> None:
        self.workers = workers
        self.queue = queue
        self.clocks = clocks
        self.alive_count = len(workers)
        self.workers_lost = 0
        self.workers_joined = 0
        # (rank, incarnation, what, seconds since start, why, time.time()): joins, drops, leaves
        self.events: deque[tuple[int, int, str, float, str, float]] = deque(maxlen=RECORD_LIMIT)
        self._start = time.monotonic()

    def _event(self, w: WorkerState, what: str, why: str) -> None:
        self.events.append((w.rank, w.incarnation, what, time.monotonic() - self._start, why, time.time()))

    def admit(self, rank: int, incarnation: int, name: str) -> WorkerState:
        """A fresh record for ``rank``'s ``incarnation``: alive, clock 0, and in the staleness frame at
        the others' lowest clock, so that a newcomer does not hold them back."""
        low = self.clocks.min_all()
        w = self.workers[rank] = WorkerState(rank, incarnation, name, offset=low if low is not None else 0)
        self.alive_count += 1
        self.queue.joined(rank)
        self.workers_joined += int(incarnation > 0)
        self._event(w, "join", name)
        self.clocks.push(w)
        self.clocks.log()
        return w

    def remove(self, w: WorkerState, reason: str, *, lost: bool, held: HeldRequests) -> list[Ready]:
        """``w`` is out of the run, lost (dropped) or gone after finishing (``lost=False``): its held
        requests fail, its unpushed batches are redrawn, and the others' held requests are retried."""
        w.alive = False
        self.alive_count -= 1
        self.workers_lost += int(lost)
        self._event(w, "drop" if lost else "leave", reason)
        ready: list[Ready] = [(h.future, ShardError(f"worker {w.rank} was dropped: {reason}")) for h in held.take(w)]
        self.queue.dropped(w)
        w.version += 1  # out of the staleness frame
        self.clocks.log()
        return ready + held.release_credit() + held.retry_all()

    @abstractmethod
    def check_refill(self, w: WorkerState, epoch: int, plan: DataPlan, incarnation: int) -> str | None:
        """What is wrong with ``w``'s refill of loop epoch ``epoch`` (``None``: nothing)."""

    @abstractmethod
    def sources(self, w: WorkerState, held: Held) -> list[tuple[Epoch, int]] | None:
        """(epoch, batches it may give ``w``), oldest first; ``[]``: over; ``None``: wait for work."""

    @abstractmethod
    def timed_out(self, run: Run, held: Held, error: ShardError) -> list[Ready]:
        """``held`` waited past its deadline (under the lock): the answers to give."""

    @abstractmethod
    def failed(self, run: Run, worker: int, reason: str) -> None:
        """Worker ``worker`` failed (outside the lock)."""


class FixedMembership(Membership):
    """Every worker trains from start to end; each worker's first refill of an epoch opens it; a failure
    or a held request's timeout fails the run, naming who it waited for."""

    def check_refill(self, w: WorkerState, epoch: int, plan: DataPlan, incarnation: int) -> str | None:
        known = self.queue.epochs.get(epoch)
        if known is None:
            self.queue.open(epoch, plan, self.alive_count)
        elif known.plan != plan:
            return (
                f"async coordinator: worker {w.rank} drew epoch {epoch} with {plan}, but another worker drew it "
                f"with {known.plan}. Expected every rank to build the same training DataLoader (dataset size, "
                "batch size, drop_last, shuffle, seed). Fix: make train_dataloader() identical on all ranks."
            )
        return None

    def sources(self, w: WorkerState, held: Held) -> list[tuple[Epoch, int]] | None:
        known = self.queue.epochs[held.epoch]
        # the last batches are kept for the workers that have not drawn in this epoch yet: a loop
        # that sees no batch skips the epoch-end validation its peers run, and their collectives
        # would never match
        reserved = 0 if known.served.get(w.rank, 0) == 0 else known.undrawn
        return [(known, len(known.queue) - reserved)] if len(known.queue) > reserved else []

    def timed_out(self, run: Run, held: Held, error: ShardError) -> list[Ready]:
        if held.credit_held:
            run.set_failure(error.message)
        return [(p.future, error) for p in run.take_held()]

    def failed(self, run: Run, worker: int, reason: str) -> None:
        # every held and later refill fails, naming it: one held on its clock would wait the whole timeout
        run.abort(f"worker {worker} failed: {reason}")


class ChangingMembership(Membership):
    """Workers join and are dropped (dedicated servers): the chief opens epochs, a lost worker's batches
    are redrawn."""

    # a held request that times out fails alone: the frozen worker it waited on is dropped meanwhile,
    # so only a much longer wait is an error of its own
    patience = 3.0

    def check_refill(self, w: WorkerState, epoch: int, plan: DataPlan, incarnation: int) -> str | None:
        if w.alive and w.incarnation == incarnation:
            return None
        return (
            f"async coordinator: worker {w.rank} (incarnation {incarnation}) was dropped from the run "
            f"(it was lost: no heartbeat, or frozen past the timeout); its batches were redrawn by the others. "
            "Fix: restart it to rejoin."
        )

    def sources(self, w: WorkerState, held: Held) -> list[tuple[Epoch, int]] | None:
        # a worker's epoch is only its loop's: batches come from the oldest epoch with batches to
        # redraw, then from the epoch the chief opened
        sources = [(e, len(e.queue)) for _, e in sorted(self.queue.epochs.items()) if e.queue]
        if sources:
            return sources
        if w.outstanding:
            # no work now, but the worker still holds batches (its loop draws one ahead of its
            # step): its loop epoch ends after them, then it comes back, for redraws or the next epoch
            return []
        return None

    def timed_out(self, run: Run, held: Held, error: ShardError) -> list[Ready]:
        held.done = True
        w = self.workers[held.worker]
        if held.gate:
            w.gate = None
        else:
            w.pending = None
        return [(held.future, error)]

    def failed(self, run: Run, worker: int, reason: str) -> None:
        run.drop(worker, f"it failed: {reason}")
