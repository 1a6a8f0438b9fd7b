"""The async coordinator, hosted by rank 0 of an ``"async"`` run."""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch.futures import Future

from lightning_strategies.comm.async_.chief import Chief
from lightning_strategies.comm.async_.clocks import SSPClocks
from lightning_strategies.comm.async_.held import HeldRequests, Ready
from lightning_strategies.comm.async_.membership import ChangingMembership, FixedMembership, Membership
from lightning_strategies.comm.async_.messages import DataPlan, GateReply, JoinReply, LeaseReply, ReportReply
from lightning_strategies.comm.async_.queue import BatchQueue
from lightning_strategies.comm.async_.watchdog import DeadlineWatchdog, deliver
from lightning_strategies.comm.async_.workers import Held, WorkerState
from lightning_strategies.comm.rpc import ShardError, completed

__all__ = ["AsyncCoordinator"]


def _part(path: str, doc: str) -> Any:
    """A read-only property returning ``self.<path>``, a dotted path into one of the coordinator's parts."""
    return property(operator.attrgetter(path), doc=doc)


def _per_worker_part(field: str, doc: str) -> Any:
    """A read-only property: every worker's ``field``, in rank order (read under the lock)."""
    return property(lambda self: self._per_worker(field), doc=doc)


class AsyncCoordinator:
    """The epoch's batch queue, leases, the staleness bound and worker membership, thread-safe:
    answers that must wait are futures, completed outside the lock.

    The bound is checked where steps start (:meth:`gate`), not where batches are drawn, so loader
    processes that fetch indices ahead change nothing; leases are also held back
    (:meth:`.clocks.SSPClocks.credit`). The slowest worker is never held.

    Args:
        workers: the training ranks (or their number, for ranks ``0 .. n-1``).
        max_staleness: the SSP bound ``s``; ``None`` for no bound.
        timeout: how long a held refill waits before failing, naming the workers it waited for.
        push_every: the workers' ``push_every`` (a clock counts pushes, a lease counts batches).
        elastic: workers may be dropped and may join (:class:`.membership.ChangingMembership`);
            the chief opens epochs.
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
        self.timeout = timeout
        self._workers = {r: WorkerState(r) for r in ranks}
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # acks, drops, joins: the chief waits on it
        self._clocks = SSPClocks(self._workers, max_staleness, push_every)
        self._queue = BatchQueue(self._workers, self._clocks)
        self._members: Membership = (ChangingMembership if elastic else FixedMembership)(
            self._workers, self._queue, self._clocks
        )
        self._watchdog = DeadlineWatchdog(self._lock, self._expire)
        self._chief = Chief(self._progress, self._queue, self._workers)
        self._held = HeldRequests(
            self._workers, self._clocks, self._queue, self._members, self._watchdog, self._chief, timeout
        )
        #: called (outside the lock) with (rank, incarnation, name, reason) when a worker is dropped
        self.on_drop: Callable[[int, int, str, str], None] | None = None
        #: (worker, clock in the staleness frame, lowest other clock) at every step admitted under a bound
        self.admissions = self._clocks.admissions
        #: every worker's clock after each change (-1: not alive or not active)
        self.clock_log = self._clocks.clock_log
        #: (rank, incarnation, "join"/"drop"/"leave", seconds since start, why, time.time())
        self.events = self._members.events

    # -- inspection -------------------------------------------------------------------------

    @property
    def max_staleness(self) -> int | None:
        return self._clocks.max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int | None) -> None:
        self._clocks.max_staleness = value

    workers_lost: int = _part("_members.workers_lost", "Workers dropped (lost, failed or frozen).")
    workers_joined: int = _part("_members.workers_joined", "Workers that rejoined as a new incarnation.")
    batches_redrawn: int = _part("_queue.batches_redrawn", "Batches put back after their worker was lost.")
    batches_returned: int = _part("_queue.batches_returned", "Leased batches a worker gave back untrained.")
    current_epoch: int | None = _part("_chief.current", "The epoch the chief opened last (membership runs).")
    stopped: bool = _part("_chief.stopped", "The run is over (:meth:`close`).")

    @property
    def ranks(self) -> list[int]:
        """Every worker rank the coordinator knows, in order."""
        return sorted(self._workers)

    def _per_worker(self, field: str) -> list[Any]:
        with self._lock:
            return [getattr(self._workers[r], field) for r in self.ranks]

    clocks: list[int] = _per_worker_part("clock", "Every worker's clock (pushes reported), in rank order.")
    wait_seconds: list[float] = _per_worker_part(
        "wait_seconds", "Seconds each worker's refills were held by the staleness bound, in rank order."
    )
    held_refills: list[int] = _per_worker_part(
        "held_refills", "Refills held by the staleness bound, per worker in rank order."
    )

    @property
    def alive(self) -> list[int]:
        """The ranks of the workers alive now."""
        with self._lock:
            return sorted(r for r, w in self._workers.items() if w.alive)

    def served(self, epoch: int) -> list[int]:
        """Batches leased to each worker in epoch ``epoch``, in rank order (zeros when unknown)."""
        with self._lock:
            return self._queue.served(epoch, self.ranks)

    def remaining(self, epoch: int) -> int:
        """Batches of epoch ``epoch`` not leased yet."""
        with self._lock:
            return self._queue.remaining(epoch)

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

    def accounting(self, epoch: int) -> dict[str, Any]:
        """Who counted each batch of ``epoch`` (``done``: index -> rank), and the redrawn indices."""
        with self._lock:
            return self._queue.accounting(epoch)

    def done_count(self, epoch: int) -> int:
        """Batches of ``epoch`` acked so far."""
        with self._lock:
            return self._queue.done_count(epoch)

    def left_or_lost(self) -> bool:
        """(Membership) Whether every worker has left or been dropped."""
        return not self.alive

    # -- refills, reports, gates --------------------------------------------------------------

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
        """Lease up to ``want`` more batches to ``worker``, after taking its clock and acks: held while
        the bound leaves no credit (``prefetch`` more allowed: the loader's batches ahead of its
        steps) or there is no work yet; with no work left, the answer is ``over``."""
        fut: Future[LeaseReply | ShardError] = Future()
        ready: list[Ready] = []
        with self._lock:
            w = self._workers.get(worker)
            if self._chief.failure is not None:
                return completed(ShardError(f"the async coordinator has failed earlier: {self._chief.failure}"))
            if w is None:
                unknown = f"async coordinator: refill from worker {worker}, expected one of the workers {self.ranks}"
                return completed(ShardError(unknown))
            error = self._members.check_refill(w, epoch, plan, incarnation)
            if error is not None:
                return completed(ShardError(error))
            self._queue.take_acks(w, acks)
            opened = self._clocks.set_clock(w, clock)
            held = self._held.new(worker, fut, epoch=epoch, want=max(1, want), prefetch=max(0, prefetch))
            if w.pending is not None and not w.pending.done:  # a new refill replaces an older held one
                ready.append((w.pending.future, self._held.empty_reply(w, w.pending)))
                w.pending.done = True
            answer = self._held.answer(w, held)
            if answer is not None:
                ready.append((fut, answer))
            else:
                self._held.hold(w, held)
            if opened:
                ready += self._held.release_credit()
            if acks:
                self._progress.notify_all()
        deliver(ready)
        return fut

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
        """``worker`` has pushed ``clock`` times, the last pushes carrying ``acks``; never waits.
        ``finished``: it trained every batch of its loop epoch (it no longer holds the others back);
        ``publish``: values for the chief; ``returned``: leased batches it will not train (requeued)."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or w.incarnation != incarnation:
                return ReportReply(None)  # a dropped worker's late report changes nothing
            self._queue.take_acks(w, acks)
            if publish:
                self._chief.published.update(publish)
            if returned:
                self._queue.requeue(w, [(int(e), int(i)) for e, i in returned], redrawn=False)
            changed = self._clocks.set_clock(w, clock)
            # a worker out of its loop epoch's batches no longer holds the others back, unless a later epoch
            # is open already (its report came after another worker opened the next one, which it trains too)
            if finished and not w.outstanding and w.active and not self._queue.later_epoch_open(w):
                self._clocks.set_active(w, False)
                self._clocks.log()
                changed = True
            ready = self._held.release_credit() if changed else []
            if returned:
                ready += self._held.retry_all()  # work came back: the held refills may take it
            if w.pending is not None and not w.pending.done and w.pending.credit_held:
                ready += self._held.retry(w.pending)  # its own acks gave it credit
            if acks:
                self._progress.notify_all()
            low = self._clocks.min_other(worker)
        deliver(ready)
        return ReportReply(low)

    def gate(self, worker: int, clock: int, *, incarnation: int = 0) -> Future[GateReply | ShardError]:
        """Open when every other (active) worker has pushed ``clock - max_staleness`` times (``clock``:
        at the step about to start, in the bound's frame); a held gate fails after ``timeout``."""
        with self._lock:
            w = self._workers.get(worker)
            if self._chief.failure is not None:
                return completed(ShardError(f"the async coordinator has failed earlier: {self._chief.failure}"))
            if w is None or not w.alive or w.incarnation != incarnation:
                return completed(ShardError(f"async coordinator: gate of worker {worker}, which is not in the run"))
            s = self.max_staleness
            low = self._clocks.min_other(worker)
            need = clock - (s or 0)
            if s is None or low is None or low >= need:
                if s is not None and low is not None:
                    self.admissions.append((worker, clock, low))
                return completed(GateReply(low))
            fut: Future[GateReply | ShardError] = Future()
            self._held.hold(w, self._held.new(worker, fut, need=need, credit_held=True, gate=True))
        return fut

    def _expire(self, held: Held) -> list[Ready]:
        return self._members.timed_out(self, held, self._held.timeout_error(held))

    # -- failures and membership ---------------------------------------------------------------

    def take_held(self) -> list[Held]:
        """Every request still held, each marked answered (holding the lock)."""
        return self._held.take_all()

    def set_failure(self, message: str) -> None:
        """The run failed with ``message`` (holding the lock): every later request fails with it."""
        self._chief.failure = message

    def fail(self, worker: int, reason: str) -> None:
        """Worker ``worker`` failed: with membership it is dropped; else every held and later refill fails."""
        self._members.failed(self, worker, reason)

    def abort(self, reason: str) -> None:
        """The run cannot go on (a server is lost): every held and later refill fails with ``reason``,
        and so does the chief's :meth:`wait_done`."""
        with self._lock:
            if self._chief.failure is None:
                self._chief.failure = reason
            error = ShardError(self._chief.failure)
            held = self._held.take_all()
            self._progress.notify_all()
        deliver([(h.future, error) for h in held])

    def join(self, worker: int, incarnation: int, name: str = "") -> JoinReply:
        """(Membership) ``worker`` starts, or restarts as ``incarnation`` (see :meth:`.membership.Membership.admit`)."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                raise ValueError(f"async coordinator: join of rank {worker}, expected one of the workers {self.ranks}")
            restarted = w.incarnation != incarnation or not w.alive
            if w.alive and w.incarnation != incarnation:
                why = f"rank {worker} restarted as incarnation {incarnation}"
                self._members.remove(w, why, lost=True, held=self._held)
            if restarted:
                w = self._members.admit(worker, incarnation, name)
            w.name, w.joined = name or w.name, True
            self._progress.notify_all()
            epoch = self._chief.current if self._chief.current is not None else 0
            return JoinReply(epoch, w.offset, self._chief.lrs, dict(self._chief.published))

    def drop(self, worker: int, reason: str, *, incarnation: int | None = None) -> bool:
        """(Membership) Drop ``worker`` (lost, failed or frozen past the timeout): its leased, unpushed
        batches are leased again. Returns whether it was alive (and ``incarnation`` matched, if given)."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or (incarnation is not None and w.incarnation != incarnation):
                return False
            ready = self._members.remove(w, reason, lost=True, held=self._held)
            self._progress.notify_all()
            name, inc = w.name, w.incarnation
        deliver(ready)
        if self.on_drop is not None:
            self.on_drop(worker, inc, name, reason)
        return True

    def leave(self, worker: int, incarnation: int = 0) -> None:
        """(Membership) ``worker`` finished the run and leaves (not counted as lost)."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None or not w.alive or w.incarnation != incarnation:
                return
            ready = self._members.remove(w, "left", lost=False, held=self._held)
            self._progress.notify_all()
        deliver(ready)

    # -- the chief (membership) -------------------------------------------------------------

    def open_epoch(self, epoch: int, plan: DataPlan) -> None:
        """Open data epoch ``epoch``: its batches are leased from now on (held refills are answered)."""
        with self._lock:
            if epoch not in self._queue.epochs:
                self._queue.open(epoch, plan, self._members.alive_count)
            self._clocks.activate_all()
            self._chief.current = epoch
            ready = self._held.retry_all()
        deliver(ready)

    def wait_done(
        self, epoch: int, at_least: int, *, timeout: float, should_stop: Callable[[], bool] | None = None
    ) -> int:
        """Block until ``at_least`` batches of ``epoch`` are acked (or the epoch is complete).

        Raises:
            TimeoutError: no worker was alive for ``timeout`` seconds while waiting.
            RuntimeError: ``should_stop`` returned True, or the coordinator failed.
        """
        return self._chief.wait_done(epoch, at_least, timeout=timeout, should_stop=should_stop)

    def close(self) -> None:
        """(Membership) The run is over: every held and later refill is answered ``stop``."""
        with self._lock:
            self._chief.stopped = True
            ready = self._held.retry_all()
        deliver(ready)

    def set_lrs(self, lrs: Sequence[float]) -> None:
        """(Membership) The chief's current learning rates, handed to every worker with its leases."""
        with self._lock:
            self._chief.lrs = [float(x) for x in lrs]

    def publish(self, **state: Any) -> None:
        """(Membership) Keep ``state`` (scheduler states, buffers, ...) for joining workers and the chief."""
        with self._lock:
            self._chief.published.update(state)

    def published(self, key: str) -> Any:
        """The value last :meth:`publish` ed under ``key`` (``None`` if none)."""
        with self._lock:
            return self._chief.published.get(key)

    def shutdown(self) -> None:
        """Stop the watchdog thread and fail what is still held (at teardown)."""
        with self._lock:
            held = self._held.take_all()
            thread = self._watchdog.close()
        deliver([(h.future, ShardError("the async coordinator shut down")) for h in held])
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
