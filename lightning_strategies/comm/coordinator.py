"""The async coordinator: the epoch's batch queue, leases, the staleness bound and worker membership.

Hosted by rank 0 of an ``"async"`` run, with no Lightning import. A worker does not ask it for
each batch: it takes its batches from a local *lease* of a few batches, refilled in the
background before it runs dry (:mod:`lightning_strategies.comm.lease`, the worker's side). A
refill carries the worker's clock (its pushes) and the batches it has pushed since the last one
(*acks*), so no tick RPC per step is needed; with a staleness bound the worker also sends its
clock after each push, coalesced to at most one message in flight.

The stale-synchronous-parallel (SSP) bound (Ho et al. 2013): no worker starts step ``c+1`` before
every other worker has pushed ``c - s`` times. It is checked where steps start, in the training
process (:meth:`AsyncCoordinator.gate`), not where batches are drawn, so loader processes
(``DataLoader(num_workers > 0)``) that fetch indices ahead change nothing. Each leased batch
carries the others' lowest clock when it was leased; a step whose clock that already allows asks
nothing, the others wait in :meth:`~AsyncCoordinator.gate` until the slow workers' pushes open
it. Leases are also held back (flow control), so that a fast worker cannot hoard the queue while
it waits: with ``push_every = k``, the others' lowest clock ``m`` and ``h`` batches leased and not
yet pushed, a worker at clock ``c`` gets at most ``(m + s + 1 - c) k - h + p`` more, ``p`` being
its loader's prefetch depth. Held gates and refills wait in one heap keyed by the clock they need
(one heap operation per clock change: no scan over all workers), and the slowest worker is never
held, so some worker always progresses. A worker that has finished the epoch's batches (its last
push reported) no longer holds the others back until the next epoch starts: at an epoch's tail a
faster worker may run ahead of it by the batches it already holds.

Membership (``elastic=True``, used with dedicated servers): workers join (a relaunched one takes
its old rank's slot, with a new *incarnation*) and are dropped when lost; a dropped worker's
leased and unpushed batches go back to the front of the queue (*redrawn*), and every batch of an
epoch is counted once, by the worker whose ack arrived first. The chief (the rank hosting this
object) opens each epoch, waits for it to complete (every batch acked) and closes the run.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from lightning_strategies.comm.rpc import ShardError, completed, hosted_coordinator, local_coordinator

__all__ = [
    "RECORD_LIMIT",
    "AsyncCoordinator",
    "DataPlan",
    "GateReply",
    "JoinReply",
    "LeaseReply",
    "LeasedBatch",
    "ReportReply",
]

# Records kept for inspection (tests, logs), bounded so that a long run's memory stays flat:
# about 1.3 MB per kind at this size, far more than any test or report reads.
RECORD_LIMIT = 10_000


@dataclass(frozen=True)
class DataPlan:
    """How an epoch's samples become batches; every worker must send the same plan.

    Attributes:
        num_samples: samples in the training set.
        batch_size: indices per batch.
        drop_last: drop the last batch when it is short (as ``DataLoader(drop_last=True)``).
        shuffle: a fresh permutation every epoch (seeded by ``seed + epoch``), else in order.
        seed: base seed of the permutation.
    """

    num_samples: int
    batch_size: int
    drop_last: bool = False
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.batch_size < 1:
            raise ValueError(
                f"DataPlan(num_samples={self.num_samples}, batch_size={self.batch_size}): expected "
                "num_samples >= 0 and batch_size >= 1"
            )

    @property
    def num_batches(self) -> int:
        """Batches in one epoch over all workers."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches, in the order the queue hands them out."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        ids = order.tolist()
        return [ids[i : i + self.batch_size] for i in range(0, self.batch_size * self.num_batches, self.batch_size)]


@dataclass(frozen=True)
class LeasedBatch:
    """One batch of a lease.

    Attributes:
        epoch: the data epoch it belongs to (under membership it may be trained in a later loop epoch).
        index: its position among the epoch's batches (:meth:`DataPlan.batches`).
        indices: its sample indices.
        admitted_min: the lowest clock (in the staleness frame) of the other workers when it was
            leased; with a bound the worker checks its own clock against it at the step
            (``None`` without a bound or without other workers).
    """

    epoch: int
    index: int
    indices: list[int]
    admitted_min: int | None = None


@dataclass
class LeaseReply:
    """The coordinator's answer to a refill.

    Attributes:
        batches: the leased batches (possibly none).
        over: no further batch of this worker's loop epoch: its epoch ends once its lease is used.
        stop: the run is over (membership runs: the chief closed it).
        waited: seconds the refill was held (staleness credit, or no work yet).
        offset: added to this worker's clock in the staleness bound (a joined worker starts at
            the others' lowest clock).
        lrs: the chief's learning rates, per param group (membership runs), else ``None``.
        pace: the worker's speed over the mean worker's (1 until speeds are measured): a slow
            worker holds a smaller lease, so the epoch's last batches do not wait in it.
    """

    batches: list[LeasedBatch]
    over: bool = False
    stop: bool = False
    waited: float = 0.0
    offset: int = 0
    lrs: list[float] | None = None
    pace: float = 1.0


@dataclass
class ReportReply:
    """The answer to a clock report: the lowest clock of the other workers (``None``: no other)."""

    min_other: int | None


@dataclass
class GateReply:
    """The answer to a staleness gate: the others' lowest clock, and the seconds it was held."""

    min_other: int | None
    waited: float = 0.0


@dataclass
class JoinReply:
    """What a joining worker needs from the coordinator.

    Attributes:
        epoch: the run's current (or next) data epoch.
        offset: the worker's staleness offset (see :class:`LeaseReply`).
        lrs: the chief's learning rates (``None`` before the chief published any).
        state: whatever the chief published for joiners (:meth:`AsyncCoordinator.publish`), e.g.
            its LR schedulers' state and the latest buffers.
    """

    epoch: int
    offset: int
    lrs: list[float] | None
    state: dict[str, Any]


@dataclass
class _Pending:
    """A refill or a staleness gate the coordinator could not answer yet."""

    worker: int
    epoch: int
    want: int
    start: float
    future: Future[Any]
    deadline: float
    need: int = 0  # the lowest clock of the others that opens it (staleness holds)
    credit_held: bool = False
    done: bool = False
    prefetch: int = 0
    gate: bool = False


@dataclass
class _Worker:
    rank: int
    incarnation: int = 0
    name: str = ""
    alive: bool = True
    clock: int = 0
    offset: int = 0
    # (epoch, index) leased to this worker and not acked yet
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    pending: _Pending | None = None
    gate: _Pending | None = None
    active: bool = True  # counted in the others' bound (False once it finished the epoch's batches)
    version: int = 0  # bumped on every clock change: heap entries of older versions are stale
    wait_seconds: float = 0.0
    held_refills: int = 0
    rate: float | None = None  # batches acked per second (a moving average)
    last_ack: float | None = None
    joined: bool = False  # membership: this incarnation registered (its heartbeat is watched from then on)

    @property
    def gate_clock(self) -> int:
        return self.clock + self.offset


@dataclass
class _Epoch:
    number: int
    plan: DataPlan
    batches: list[list[int]]
    queue: deque[int]
    served: dict[int, int]  # rank -> batches leased in this epoch
    undrawn: int  # alive workers that have not been leased a batch of this epoch yet
    done: dict[int, int] = field(default_factory=dict)  # index -> rank whose ack counted it
    redrawn: list[int] = field(default_factory=list)  # indices put back after a worker was lost

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.batches)


class AsyncCoordinator:
    """The epoch's batch queue, leases, the staleness bound and (optionally) worker membership.

    Every method is thread-safe: RPC threads call it concurrently. Answers that must wait are
    futures, completed outside the lock (a future's callbacks serialise the RPC reply inline).

    Args:
        workers: the training ranks (or their number, for ranks ``0 .. n-1``).
        max_staleness: the SSP bound ``s``; ``None`` for no bound.
        timeout: how long a held refill waits before failing with an error naming the workers it
            waited for.
        push_every: the workers' ``push_every`` (a clock counts pushes, a lease counts batches).
        elastic: workers may be dropped and may join (see the module doc); the chief opens epochs.
    """

    def __init__(
        self,
        workers: int | Sequence[int],
        max_staleness: int | None,
        *,
        timeout: timedelta = timedelta(minutes=30),
        push_every: int = 1,
        elastic: bool = False,
    ) -> None:
        ranks = list(range(workers)) if isinstance(workers, int) else list(workers)
        if not ranks:
            raise ValueError(f"AsyncCoordinator(workers={workers!r}): expected at least one worker")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, found {max_staleness}")
        if push_every < 1:
            raise ValueError(f"push_every must be >= 1, found {push_every}")
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.push_every = push_every
        self.elastic = elastic
        self._workers = {r: _Worker(r) for r in ranks}
        self._alive_count = len(ranks)
        self._rate_sum = 0.0  # over the alive workers with a measured rate
        self._rated = 0
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # acks, drops, joins: the chief waits on it
        self._epochs: dict[int, _Epoch] = {}
        self._current: int | None = None  # membership: the epoch the chief opened last
        self._stopped = False
        self._failure: str | None = None
        self._clocks: list[tuple[int, int, int]] = []  # heap of (gate clock, rank, version)
        self._waiting: list[tuple[int, int, _Pending]] = []  # heap of (need, seq, refill held on credit)
        self._deadlines: list[tuple[float, int, _Pending]] = []  # heap of (deadline, seq, held refill)
        self._seq = itertools.count()
        self._watchdog: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._lrs: list[float] | None = None
        self._published: dict[str, Any] = {}
        self.workers_lost = 0
        self.workers_joined = 0
        self.batches_redrawn = 0
        self.batches_returned = 0
        #: called (outside the lock) with (rank, incarnation, name, reason) when a worker is dropped
        self.on_drop: Callable[[int, int, str, str], None] | None = None
        # (worker, clock in the staleness frame, lowest other clock) at every batch leased under a bound
        self.admissions: deque[tuple[int, int, int]] = deque(maxlen=RECORD_LIMIT)
        # every worker's clock after each change (-1: not alive)
        self.clock_log: deque[tuple[int, ...]] = deque(maxlen=RECORD_LIMIT)
        # (rank, incarnation, what, seconds since start, why, time.time()): joins, drops, leaves
        self.events: deque[tuple[int, int, str, float, str, float]] = deque(maxlen=RECORD_LIMIT)
        self._start = time.monotonic()
        for r in ranks:
            self._push_clock(self._workers[r])

    # -- inspection -------------------------------------------------------------------------

    @property
    def ranks(self) -> list[int]:
        """Every worker rank the coordinator knows, in order."""
        return sorted(self._workers)

    @property
    def clocks(self) -> list[int]:
        """Every worker's clock (pushes reported), in rank order."""
        with self._lock:
            return [self._workers[r].clock for r in sorted(self._workers)]

    @property
    def wait_seconds(self) -> list[float]:
        """Seconds each worker's refills were held by the staleness bound, in rank order."""
        with self._lock:
            return [self._workers[r].wait_seconds for r in sorted(self._workers)]

    @property
    def held_refills(self) -> list[int]:
        """Refills held by the staleness bound, per worker in rank order."""
        with self._lock:
            return [self._workers[r].held_refills for r in sorted(self._workers)]

    @property
    def alive(self) -> list[int]:
        """The ranks of the workers alive now."""
        with self._lock:
            return sorted(r for r, w in self._workers.items() if w.alive)

    @property
    def current_epoch(self) -> int | None:
        """The epoch the chief opened last (membership runs)."""
        return self._current

    def served(self, epoch: int) -> list[int]:
        """Batches leased to each worker in epoch ``epoch``, in rank order (zeros when unknown)."""
        with self._lock:
            known = self._epochs.get(epoch)
            return [known.served.get(r, 0) if known else 0 for r in sorted(self._workers)]

    def remaining(self, epoch: int) -> int:
        """Batches of epoch ``epoch`` not leased yet."""
        with self._lock:
            known = self._epochs.get(epoch)
            return len(known.queue) if known is not None else 0

    def name_of(self, rank: int) -> str:
        """The RPC name the current incarnation of ``rank`` joined under ('' before it joined)."""
        with self._lock:
            w = self._workers.get(rank)
            return w.name if w is not None else ""

    def joined(self, rank: int) -> bool:
        """Whether the current incarnation of ``rank`` has joined (membership runs)."""
        with self._lock:
            w = self._workers.get(rank)
            return w is not None and w.alive and w.joined

    @property
    def stopped(self) -> bool:
        """The run is over (:meth:`close`)."""
        return self._stopped

    def accounting(self, epoch: int) -> dict[str, Any]:
        """Who counted each batch of ``epoch`` (``done``: index -> rank), and the redrawn indices."""
        with self._lock:
            known = self._epochs.get(epoch)
            if known is None:
                return {"num_batches": 0, "done": {}, "redrawn": []}
            return {"num_batches": len(known.batches), "done": dict(known.done), "redrawn": list(known.redrawn)}

    def done_count(self, epoch: int) -> int:
        """Batches of ``epoch`` acked so far."""
        with self._lock:
            known = self._epochs.get(epoch)
            return len(known.done) if known is not None else 0

    # -- the staleness frame ----------------------------------------------------------------

    def _push_clock(self, worker: _Worker) -> None:
        worker.version += 1
        if worker.alive and worker.active:
            heapq.heappush(self._clocks, (worker.gate_clock, worker.rank, worker.version))
        if len(self._clocks) > 4 * len(self._workers) + 16:  # stale entries pile up above the minimum
            self._clocks = [(w.gate_clock, w.rank, w.version) for w in self._workers.values() if w.alive and w.active]
            heapq.heapify(self._clocks)

    def _clean_top(self) -> None:
        while self._clocks:
            _, rank, version = self._clocks[0]
            w = self._workers[rank]
            if w.alive and w.active and w.version == version:
                return
            heapq.heappop(self._clocks)

    def _min_other(self, rank: int) -> int | None:
        """The lowest staleness-frame clock among the other alive, active workers (O(log P))."""
        self._clean_top()
        if not self._clocks:
            return None
        if self._clocks[0][1] != rank:
            return self._clocks[0][0]
        mine = heapq.heappop(self._clocks)
        self._clean_top()
        other = self._clocks[0][0] if self._clocks else None
        heapq.heappush(self._clocks, mine)
        return other

    def _min_all(self) -> int | None:
        self._clean_top()
        return self._clocks[0][0] if self._clocks else None

    def _credit(self, w: _Worker) -> tuple[int | None, int | None]:
        """(batches ``w`` may still be leased, the lowest other clock); ``None`` credit: unbounded."""
        if self.max_staleness is None:
            return None, None
        low = self._min_other(w.rank)
        if low is None:
            return None, None  # alone: nobody to wait for
        allowed = (low + self.max_staleness + 1 - w.gate_clock) * self.push_every - len(w.outstanding)
        return allowed, low

    def _set_active(self, w: _Worker, active: bool) -> None:
        if w.active != active:
            w.active = active
            self._push_clock(w)  # a new version: in the heap when active, out of it when not

    def _activate_all(self) -> None:
        """A new epoch starts: the workers that finished the last one count again (O(P), per epoch)."""
        for w in self._workers.values():
            if w.alive:
                self._set_active(w, True)

    def _set_clock(self, w: _Worker, clock: int) -> bool:
        if clock <= w.clock:
            return False
        w.clock = clock
        self._push_clock(w)
        self._log_clocks()
        return True

    def _log_clocks(self) -> None:
        self.clock_log.append(tuple(w.clock if w.alive and w.active else -1 for _, w in sorted(self._workers.items())))

    # -- refills ----------------------------------------------------------------------------

    def refill(
        self,
        worker: int,
        epoch: int,
        want: int,
        *,
        clock: int,
        acks: Sequence[tuple[int, int]] = (),
        plan: DataPlan,
        incarnation: int = 0,
        prefetch: int = 0,
    ) -> Future[LeaseReply | ShardError]:
        """Lease up to ``want`` more batches to ``worker``, after taking its clock and acks.

        Without membership the batches come from epoch ``epoch``'s queue (built from ``plan`` by
        the first worker to ask). Every worker gets at least one batch per epoch when the epoch
        has as many batches as workers: the last batches are kept for workers that have not
        drawn yet (a training loop that sees no batch skips the epoch-end validation its peers
        run, and their collectives would never match). With membership the worker's ``epoch`` is
        only its loop's: batches come from the oldest open epoch with batches to redraw, then the
        epoch the chief opened. With no work left, a worker that still holds batches is told
        ``over`` (its loop epoch ends after them: its loop draws one batch ahead of its step, so it
        could not finish them while waiting); one that holds none waits for work (a redraw, the
        next epoch) or for the end of the run.

        The future completes at once unless the staleness bound leaves no credit (``prefetch``:
        the batches the worker's loader holds ahead of its steps, allowed on top) or (membership)
        there is no work yet; a held refill fails after ``timeout``, naming the workers it waited for.
        """
        fut: Future[LeaseReply | ShardError] = Future()
        ready: list[tuple[Future[Any], Any]] = []
        with self._lock:
            error = self._check_refill(worker, epoch, plan, incarnation)
            if error is not None:
                return completed(ShardError(error))
            w = self._workers[worker]
            self._take_acks(w, acks)
            opened = self._set_clock(w, clock)
            now = time.monotonic()
            # with membership a refill may wait on a frozen worker, which is dropped after `timeout`
            # (then the wait ends): only a much longer wait is an error of its own
            patience = self.timeout.total_seconds() * (3 if self.elastic else 1)
            pending = _Pending(worker, epoch, max(1, want), now, fut, now + patience, prefetch=max(0, prefetch))
            if w.pending is not None and not w.pending.done:  # a new refill replaces an older held one
                ready.append((w.pending.future, self._empty_reply(w, w.pending)))
                w.pending.done = True
            answer = self._answer(w, pending)
            if answer is not None:
                ready.append((fut, answer))
            else:
                self._hold(w, pending)
            if opened:
                ready += self._release_credit()
            if acks:
                self._progress.notify_all()
        _deliver(ready)
        return fut

    def _check_refill(self, worker: int, epoch: int, plan: DataPlan, incarnation: int) -> str | None:
        if self._failure is not None:
            return f"the async coordinator has failed earlier: {self._failure}"
        w = self._workers.get(worker)
        if w is None:
            return f"async coordinator: refill from worker {worker}, expected one of the workers {self.ranks}"
        if self.elastic and (not w.alive or w.incarnation != incarnation):
            return (
                f"async coordinator: worker {worker} (incarnation {incarnation}) was dropped from the run "
                f"(it was lost: no heartbeat, or frozen past the timeout); its batches were redrawn by the others. "
                "Fix: restart it to rejoin."
            )
        if self.elastic:
            return None
        known = self._epochs.get(epoch)
        if known is None:
            self._new_epoch(epoch, plan)
        elif known.plan != plan:
            return (
                f"async coordinator: worker {worker} drew epoch {epoch} with {plan}, but another worker drew it "
                f"with {known.plan}. Expected every rank to build the same training DataLoader (dataset size, "
                "batch size, drop_last, shuffle, seed). Fix: make train_dataloader() identical on all ranks."
            )
        return None

    def _new_epoch(self, epoch: int, plan: DataPlan) -> _Epoch:
        batches = plan.batches(epoch)
        known = self._epochs[epoch] = _Epoch(epoch, plan, batches, deque(range(len(batches))), {}, self._alive_count)
        self._activate_all()
        for old in [e for e in self._epochs if e < epoch - 2 and self._epochs[e].complete]:
            del self._epochs[old]  # keep the last few epochs' accounting for inspection
        return known

    def _take_acks(self, w: _Worker, acks: Iterable[tuple[int, int]]) -> None:
        new = 0
        for key in acks:
            epoch, index = int(key[0]), int(key[1])
            if (epoch, index) in w.outstanding:
                w.outstanding.discard((epoch, index))
                new += 1
            known = self._epochs.get(epoch)
            if known is not None and index not in known.done:
                known.done[index] = w.rank  # the first ack counts it; a redrawn copy's ack does not
        if new:
            now = time.monotonic()
            if w.last_ack is not None and now > w.last_ack:
                sample = new / (now - w.last_ack)
                self._set_rate(w, sample if w.rate is None else 0.5 * w.rate + 0.5 * sample)
            w.last_ack = now

    def _set_rate(self, w: _Worker, rate: float | None) -> None:
        if w.rate is not None:
            self._rate_sum -= w.rate
            self._rated -= 1
        w.rate = rate
        if rate is not None:
            self._rate_sum += rate
            self._rated += 1

    def _share(self, w: _Worker) -> float:
        """``w``'s share of the alive workers' speed (equal shares until speeds are measured), O(1)."""
        alive = max(1, self._alive_count)
        if not self._rated or w.rate is None:
            return 1.0 / alive
        mean = self._rate_sum / self._rated
        total = self._rate_sum + (alive - self._rated) * mean
        return w.rate / total if total > 0 else 1.0 / alive

    def _answer(self, w: _Worker, pending: _Pending) -> LeaseReply | None:
        """The answer to ``pending`` if it can be given now (holding the lock), else ``None``."""
        if self._stopped:
            return LeaseReply([], over=True, stop=True, offset=w.offset, lrs=self._lrs)
        sources = self._sources(w, pending)
        if sources is None:
            return None  # membership: no work yet
        if not sources:
            return LeaseReply([], over=True, waited=self._waited(pending), offset=w.offset, lrs=self._lrs)
        credit, low = self._credit(w)
        available = sum(n for _, n in sources)
        # guided leases: a worker takes at most half its share of what is left, its share by its
        # speed (batches acked per second), so the epoch's tail is spread over the workers instead
        # of sitting in a slow worker's lease
        n = min(pending.want, available, max(1, math.ceil(available * self._share(w) / 2)))
        if credit is not None:
            credit += pending.prefetch
            if credit <= 0:
                pending.credit_held = True
                assert low is not None and self.max_staleness is not None
                # credit reappears once the lowest other clock reaches this
                beyond = len(w.outstanding) - pending.prefetch
                pending.need = w.gate_clock - self.max_staleness + beyond // self.push_every
                return None
            n = min(n, credit)
        leased = self._lease(w, sources, n, low)
        pace = self._share(w) * max(1, self._alive_count)
        return LeaseReply(leased, waited=self._waited(pending), offset=w.offset, lrs=self._lrs, pace=pace)

    def _sources(self, w: _Worker, pending: _Pending) -> list[tuple[_Epoch, int]] | None:
        """(epoch, batches it may give ``w``), oldest first; ``[]``: over; ``None``: wait for work."""
        if not self.elastic:
            known = self._epochs[pending.epoch]
            first = known.served.get(w.rank, 0) == 0
            # batches kept for the workers that have not drawn in this epoch yet
            reserved = 0 if first else known.undrawn
            return [(known, len(known.queue) - reserved)] if len(known.queue) > reserved else []
        sources = [(e, len(e.queue)) for _, e in sorted(self._epochs.items()) if e.queue]
        if sources:
            return sources
        if w.outstanding:
            # no work now, but the worker still holds batches (its loop draws one ahead of its
            # step): its loop epoch ends after them, then it comes back, for redraws or the next epoch
            return []
        return None

    def _lease(self, w: _Worker, sources: list[tuple[_Epoch, int]], n: int, low: int | None) -> list[LeasedBatch]:
        leased: list[LeasedBatch] = []
        if n > 0:
            self._set_active(w, True)  # it has batches of the epoch to train: it counts
            if w.last_ack is None:
                w.last_ack = time.monotonic()  # its speed is measured from its first lease
        for known, available in sources:
            take = min(n - len(leased), available)
            number = known.number
            if take > 0 and known.served.get(w.rank, 0) == 0:
                known.undrawn -= 1
            for _ in range(take):
                index = known.queue.popleft()
                w.outstanding.add((number, index))
                known.served[w.rank] = known.served.get(w.rank, 0) + 1
                leased.append(LeasedBatch(number, index, list(known.batches[index]), low))
            if len(leased) == n:
                break
        return leased

    @staticmethod
    def _waited(pending: _Pending) -> float:
        return time.monotonic() - pending.start if pending.credit_held or pending.done else 0.0

    def _empty_reply(self, w: _Worker, pending: _Pending) -> LeaseReply:
        return LeaseReply([], waited=time.monotonic() - pending.start, offset=w.offset, lrs=self._lrs)

    def _hold(self, w: _Worker, pending: _Pending) -> None:
        w.pending = pending
        if pending.credit_held:
            w.held_refills += 1
            heapq.heappush(self._waiting, (pending.need, next(self._seq), pending))
        heapq.heappush(self._deadlines, (pending.deadline, next(self._seq), pending))
        self._ensure_watchdog()

    def _release_credit(self) -> list[tuple[Future[Any], Any]]:
        """Answer the refills held on credit that the current lowest clock opens (holding the lock)."""
        ready: list[tuple[Future[Any], Any]] = []
        low = self._min_all()
        while self._waiting and (low is None or self._waiting[0][0] <= low):
            _, _, pending = heapq.heappop(self._waiting)
            ready += self._retry(pending)
            low = self._min_all()
        return ready

    def _retry(self, pending: _Pending) -> list[tuple[Future[Any], Any]]:
        """Try a held refill or gate again (holding the lock): its answer, or it is held again."""
        w = self._workers[pending.worker]
        if pending.gate:
            return self._retry_gate(w, pending)
        if pending.done or w.pending is not pending:
            return []
        pending.credit_held = False
        answer = self._answer(w, pending)
        if answer is None:
            if pending.credit_held:  # still short of credit: wait for a higher clock
                heapq.heappush(self._waiting, (pending.need, next(self._seq), pending))
            return []
        answer.waited = time.monotonic() - pending.start
        w.wait_seconds += answer.waited if self.max_staleness is not None else 0.0
        pending.done = True
        w.pending = None
        return [(pending.future, answer)]

    def _retry_gate(self, w: _Worker, pending: _Pending) -> list[tuple[Future[Any], Any]]:
        if pending.done or w.gate is not pending:
            return []
        low = self._min_other(w.rank)
        if low is not None and low < pending.need:
            heapq.heappush(self._waiting, (pending.need, next(self._seq), pending))
            return []
        waited = time.monotonic() - pending.start
        w.wait_seconds += waited
        pending.done = True
        w.gate = None
        if low is not None:
            self.admissions.append((w.rank, pending.need + (self.max_staleness or 0), low))
        return [(pending.future, GateReply(low, waited))]

    def _retry_all(self) -> list[tuple[Future[Any], Any]]:
        """Try every held refill again (an epoch opened, work was put back, the run stopped): O(P)."""
        ready: list[tuple[Future[Any], Any]] = []
        for w in self._workers.values():
            for pending in (w.pending, w.gate):
                if pending is not None and not pending.done:
                    ready += self._retry(pending)
        return ready

    # -- clock reports ----------------------------------------------------------------------

    def report(
        self,
        worker: int,
        clock: int,
        acks: Sequence[tuple[int, int]] = (),
        *,
        incarnation: int = 0,
        finished: bool = False,
        publish: dict[str, Any] | None = None,
        returned: Sequence[tuple[int, int]] = (),
    ) -> ReportReply:
        """``worker`` has pushed ``clock`` times, and pushed the batches ``acks``; never waits.

        ``finished``: it has trained every batch it will get of its loop epoch, so it no longer
        holds the others back until an epoch starts again (it would wait for them, at validation).
        ``publish``: (membership) values the chief reads, such as the worker's latest buffers.
        ``returned``: leased batches the worker will not train: back to the front of their queues.
        """
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or w.incarnation != incarnation:
                return ReportReply(None)  # a dropped worker's late report changes nothing
            self._take_acks(w, acks)
            if publish:
                self._published.update(publish)
            if returned:
                self._requeue(w, [(int(e), int(i)) for e, i in returned], redrawn=False)
            changed = self._set_clock(w, clock)
            if finished and not w.outstanding and w.active:
                self._set_active(w, False)
                self._log_clocks()
                changed = True
            ready = self._release_credit() if changed else []
            if returned:
                ready += self._retry_all()  # work came back: the held refills may take it
            if w.pending is not None and not w.pending.done and w.pending.credit_held:
                ready += self._retry(w.pending)  # its own acks gave it credit
            if acks:
                self._progress.notify_all()
            low = self._min_other(worker)
        _deliver(ready)
        return ReportReply(low)

    def gate(self, worker: int, clock: int, *, incarnation: int = 0) -> Future[GateReply | ShardError]:
        """Open when every other (active) worker has pushed ``clock - max_staleness`` times.

        ``clock`` is the worker's clock at the step it is about to start, in the bound's frame
        (with its offset). The future completes at once when the bound allows, else when the slow
        workers' reports open it, or with an error after ``timeout`` naming them.
        """
        with self._lock:
            w = self._workers.get(worker)
            if self._failure is not None:
                return completed(ShardError(f"the async coordinator has failed earlier: {self._failure}"))
            if w is None or not w.alive or w.incarnation != incarnation:
                return completed(ShardError(f"async coordinator: gate of worker {worker}, which is not in the run"))
            low = self._min_other(worker)
            need = clock - (self.max_staleness or 0)
            if self.max_staleness is None or low is None or low >= need:
                if self.max_staleness is not None and low is not None:
                    self.admissions.append((worker, clock, low))
                return completed(GateReply(low))
            now = time.monotonic()
            patience = self.timeout.total_seconds() * (3 if self.elastic else 1)
            fut: Future[GateReply | ShardError] = Future()
            pending = _Pending(worker, -1, 0, now, fut, now + patience, need=need, credit_held=True, gate=True)
            if w.gate is not None and not w.gate.done:
                w.gate.done = True  # replaced: its worker gave up on it
            w.gate = pending
            w.held_refills += 1
            heapq.heappush(self._waiting, (need, next(self._seq), pending))
            heapq.heappush(self._deadlines, (pending.deadline, next(self._seq), pending))
            self._ensure_watchdog()
        return fut

    # -- failures, membership ---------------------------------------------------------------

    def fail(self, worker: int, reason: str) -> None:
        """Worker ``worker`` failed: with membership it is dropped; else every held and later refill
        fails, naming it (a refill held on its clock would otherwise wait the whole ``timeout``)."""
        if self.elastic:
            self.drop(worker, f"it failed: {reason}")
            return
        with self._lock:
            if self._failure is None:
                self._failure = f"worker {worker} failed: {reason}"
            waiting = self._take_all_pending()
            error = ShardError(self._failure)
        _deliver([(p.future, error) for p in waiting])

    def _take_all_pending(self) -> list[_Pending]:
        waiting = []
        for w in self._workers.values():
            for pending in (w.pending, w.gate):
                if pending is not None and not pending.done:
                    pending.done = True
                    waiting.append(pending)
            w.pending = w.gate = None
        self._waiting.clear()
        return waiting

    def join(self, worker: int, incarnation: int, name: str = "") -> JoinReply:
        """(Membership) ``worker`` starts, or restarts as ``incarnation``: alive, clock 0, and in the
        staleness frame at the others' lowest clock, so that a newcomer does not hold them back."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                raise ValueError(f"async coordinator: join of rank {worker}, expected one of the workers {self.ranks}")
            restarted = w.incarnation != incarnation or not w.alive
            if w.alive and w.incarnation != incarnation:
                self._drop_locked(w, f"rank {worker} restarted as incarnation {incarnation}")
            if restarted:
                low = self._min_all()
                self._workers[worker] = w = _Worker(worker, incarnation, name, offset=low if low is not None else 0)
                self._alive_count += 1
                for known in self._epochs.values():
                    known.undrawn += int(known.served.get(worker, 0) == 0)
                self.workers_joined += int(incarnation > 0)
                self.events.append((worker, incarnation, "join", time.monotonic() - self._start, name, time.time()))
                self._push_clock(w)
                self._log_clocks()
            w.name, w.joined = name or w.name, True
            self._progress.notify_all()
            epoch = self._current if self._current is not None else 0
            return JoinReply(epoch, w.offset, self._lrs, dict(self._published))

    def drop(self, worker: int, reason: str, *, incarnation: int | None = None) -> bool:
        """(Membership) Drop ``worker`` (lost, failed or frozen past the timeout): its leased,
        unpushed batches go back to the front of their epochs' queues and are leased again.

        Returns:
            Whether it was alive (and ``incarnation`` matched, when given).
        """
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or (incarnation is not None and w.incarnation != incarnation):
                return False
            ready = self._drop_locked(w, reason)
            name, inc = w.name, w.incarnation
        _deliver(ready)
        if self.on_drop is not None:
            self.on_drop(worker, inc, name, reason)
        return True

    def _drop_locked(self, w: _Worker, reason: str, *, lost: bool = True) -> list[tuple[Future[Any], Any]]:
        w.alive = False
        self._alive_count -= 1
        self._set_rate(w, None)
        for known in self._epochs.values():
            if known.served.get(w.rank, 0) == 0:
                known.undrawn -= 1  # nothing to keep for it any more
        self.workers_lost += int(lost)
        self.events.append(
            (w.rank, w.incarnation, "drop" if lost else "leave", time.monotonic() - self._start, reason, time.time())
        )
        ready: list[tuple[Future[Any], Any]] = []
        for pending in (w.pending, w.gate):
            if pending is not None and not pending.done:
                pending.done = True
                ready.append((pending.future, ShardError(f"worker {w.rank} was dropped: {reason}")))
        w.pending = w.gate = None
        self._requeue(w, list(w.outstanding), redrawn=True)
        w.version += 1  # out of the staleness frame
        self._log_clocks()
        ready += self._release_credit()
        ready += self._retry_all()
        self._progress.notify_all()
        return ready

    def _requeue(self, w: _Worker, batches: list[tuple[int, int]], *, redrawn: bool) -> None:
        """Put ``w``'s leased, unpushed ``batches`` back at the front of their epochs' queues."""
        for epoch, index in sorted(batches, reverse=True):
            if (epoch, index) not in w.outstanding:
                continue
            w.outstanding.discard((epoch, index))
            held = self._epochs.get(epoch)
            if held is not None and index not in held.done:
                held.queue.appendleft(index)
                if redrawn:
                    held.redrawn.append(index)
                    self.batches_redrawn += 1
                else:
                    self.batches_returned += 1

    def leave(self, worker: int, incarnation: int = 0) -> None:
        """(Membership) ``worker`` finished the run and leaves (not counted as lost)."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or w.incarnation != incarnation:
                return
            ready = self._drop_locked(w, "left", lost=False)
        _deliver(ready)

    # -- the chief (membership) -------------------------------------------------------------

    def open_epoch(self, epoch: int, plan: DataPlan) -> None:
        """Open data epoch ``epoch``: its batches are leased from now on (held refills are answered)."""
        with self._lock:
            if epoch not in self._epochs:
                self._new_epoch(epoch, plan)
            self._activate_all()
            self._current = epoch
            ready = self._retry_all()
        _deliver(ready)

    def wait_done(
        self, epoch: int, at_least: int, *, timeout: float, should_stop: Callable[[], bool] | None = None
    ) -> int:
        """Block until ``at_least`` batches of ``epoch`` are acked (or the epoch is complete).

        Raises:
            TimeoutError: no worker was alive for ``timeout`` seconds while waiting.
            RuntimeError: ``should_stop`` returned True, or the coordinator failed.
        """
        deadline = None
        with self._lock:
            while True:
                known = self._epochs.get(epoch)
                done = len(known.done) if known is not None else 0
                if known is not None and (done >= at_least or known.complete):
                    return done
                if self._failure is not None:
                    raise RuntimeError(f"async coordinator: {self._failure}")
                if any(w.alive for w in self._workers.values()):
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + timeout
                elif time.monotonic() > deadline:
                    lost = sorted(r for r, w in self._workers.items() if not w.alive)
                    raise TimeoutError(
                        f"async coordinator: every worker is gone ({lost} lost or finished) and none joined within "
                        f"{timeout:.0f}s, with {done} of {len(known.batches) if known else '?'} batches of epoch "
                        f"{epoch} done. Fix: restart the lost workers (they rejoin), or raise the strategy's `timeout`."
                    )
                if should_stop is not None and should_stop():
                    raise RuntimeError(f"async coordinator: told to stop while waiting for epoch {epoch}")
                self._progress.wait(0.25)

    def abort(self, reason: str) -> None:
        """The run cannot go on (a server is lost): every held and later refill fails with ``reason``,
        and so does the chief's :meth:`wait_done`."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
            waiting = self._take_all_pending()
            error = ShardError(self._failure)
            self._progress.notify_all()
        _deliver([(p.future, error) for p in waiting])

    def close(self) -> None:
        """(Membership) The run is over: every held and later refill is answered ``stop``."""
        with self._lock:
            self._stopped = True
            ready = self._retry_all()
        _deliver(ready)

    def set_lrs(self, lrs: Sequence[float]) -> None:
        """(Membership) The chief's current learning rates, handed to every worker with its leases."""
        with self._lock:
            self._lrs = [float(x) for x in lrs]

    def publish(self, **state: Any) -> None:
        """(Membership) Keep ``state`` (scheduler states, buffers, ...) for joining workers and the chief."""
        with self._lock:
            self._published.update(state)

    def published(self, key: str) -> Any:
        """The value last :meth:`publish` ed under ``key`` (``None`` if none)."""
        with self._lock:
            return self._published.get(key)

    def left_or_lost(self) -> bool:
        """(Membership) Whether every worker has left or been dropped."""
        with self._lock:
            return not any(w.alive for w in self._workers.values())

    # -- held refills: one watchdog thread for every deadline ------------------------------

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None and not self._closed:
            self._watchdog = threading.Thread(target=self._watch, name="async-coordinator-watchdog", daemon=True)
            self._watchdog.start()
        self._wake.notify()

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                while self._deadlines and self._deadlines[0][2].done:
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._wake.wait()
                    continue
                wait = self._deadlines[0][0] - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                _, _, pending = heapq.heappop(self._deadlines)
                if pending.done:
                    continue
                error = self._expired(pending)
                ready = [(p.future, error) for p in self._take_all_pending()] if not self.elastic else []
                if self.elastic:
                    pending.done = True
                    w = self._workers[pending.worker]
                    if pending.gate:
                        w.gate = None
                    else:
                        w.pending = None
                    ready = [(pending.future, error)]
                self._lock.release()
                try:
                    _deliver(ready)
                finally:
                    self._lock.acquire()

    def _expired(self, pending: _Pending) -> ShardError:
        w = self._workers[pending.worker]
        seconds = self.timeout.total_seconds()
        if not pending.credit_held:
            return ShardError(
                f"worker {pending.worker} waited {seconds:.0f}s for batches: no epoch was opened and none was "
                "redrawn (the chief validating or checkpointing for longer than `timeout`?). To wait longer, raise "
                "the strategy's `timeout`.",
                timed_out=True,
            )
        assert self.max_staleness is not None
        need = pending.need
        behind = {r: x.gate_clock for r, x in self._workers.items() if r != w.rank and x.alive and x.gate_clock < need}
        message = (
            f"worker {pending.worker} (clock {w.gate_clock}) waited {seconds:.0f}s for worker(s) {sorted(behind)} "
            f"(clocks {list(behind.values())}) to push step {need} (max_staleness={self.max_staleness}). Worker(s) "
            f"{sorted(behind)} died or are stuck; check their logs. To wait longer for slow workers, raise the "
            "strategy's `timeout`."
        )
        if not self.elastic:
            self._failure = message
        return ShardError(message, timed_out=True)

    def shutdown(self) -> None:
        """Stop the watchdog thread and fail what is still held (at teardown)."""
        with self._lock:
            self._closed = True
            waiting = self._take_all_pending()
            self._wake.notify_all()
            thread, self._watchdog = self._watchdog, None
        _deliver([(p.future, ShardError("the async coordinator shut down")) for p in waiting])
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


def _deliver(ready: Sequence[tuple[Future[Any], Any]]) -> None:
    # outside the lock: a future's callbacks serialise the RPC reply inline
    for fut, value in ready:
        if not fut.done():
            fut.set_result(value)


# --------------------------------------------------------------------------------------------
# RPC entry points (the worker's side calls them through comm.lease)
# --------------------------------------------------------------------------------------------


@rpc.functions.async_execution
def _rpc_refill(
    worker: int,
    epoch: int,
    want: int,
    clock: int,
    acks: list[tuple[int, int]],
    plan: DataPlan,
    incarnation: int,
    prefetch: int,
) -> Future[LeaseReply | ShardError]:
    # returns the coordinator's future at once: the RPC thread is free while the refill is held
    return hosted_coordinator().refill(
        worker, epoch, want, clock=clock, acks=acks, plan=plan, incarnation=incarnation, prefetch=prefetch
    )


@rpc.functions.async_execution
def _rpc_gate(worker: int, clock: int, incarnation: int) -> Future[GateReply | ShardError]:
    return hosted_coordinator().gate(worker, clock, incarnation=incarnation)


def _rpc_report(
    worker: int,
    clock: int,
    acks: list[tuple[int, int]],
    incarnation: int,
    finished: bool,
    publish: dict[str, Any] | None,
    returned: list[tuple[int, int]],
) -> ReportReply:
    # a last report may arrive after the coordinator's teardown: the clocks no longer matter then
    coordinator = local_coordinator()
    if coordinator is None:
        return ReportReply(None)
    return coordinator.report(
        worker, clock, acks, incarnation=incarnation, finished=finished, publish=publish, returned=returned
    )


def _rpc_fail(worker: int, reason: str) -> None:
    coordinator = local_coordinator()
    if coordinator is not None:
        coordinator.fail(worker, reason)


def _rpc_join(worker: int, incarnation: int, name: str) -> JoinReply:
    return hosted_coordinator().join(worker, incarnation, name)


def _rpc_leave(worker: int, incarnation: int) -> None:
    coordinator = local_coordinator()
    if coordinator is not None:
        coordinator.leave(worker, incarnation)


def _rpc_published(key: str) -> Any:
    coordinator = local_coordinator()
    return coordinator.published(key) if coordinator is not None else None


def _rpc_ping() -> bool:
    return True


def _rpc_run_state(epoch: int) -> tuple[int, bool, bool, bool]:
    """(batches of ``epoch`` done, epoch complete, run stopped, every worker gone): servers poll it."""
    coordinator = hosted_coordinator()
    done = coordinator.done_count(epoch)
    complete = done > 0 and done == coordinator.accounting(epoch)["num_batches"]
    return done, complete, coordinator.stopped, coordinator.left_or_lost()
