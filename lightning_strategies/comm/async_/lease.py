"""The worker's side of the async coordinator (no Lightning import): a local lease of batches, refilled
in the background, and the worker's clock reports.

Every wait is bounded (the RPC timeout exceeds the coordinator's own) and polls ``should_stop``, so a
process told to stop does not sit out the timeout.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torch.futures import Future

from lightning_strategies.comm.async_.endpoints import (
    _rpc_fail,
    _rpc_gate,
    _rpc_join,
    _rpc_leave,
    _rpc_published,
    _rpc_refill,
    _rpc_report,
    local_coordinator,
)
from lightning_strategies.comm.async_.messages import (
    RECORD_LIMIT,
    DataPlan,
    GateReply,
    JoinReply,
    LeasedBatch,
    LeaseReply,
)
from lightning_strategies.comm.rpc import call_host, wait_reply

__all__ = ["DEFAULT_LEASE", "BatchLease", "fetch_published", "join_run", "leave_run", "report_failure"]

#: Batches a worker leases at a time: enough to hide a refill's round trip behind a few steps, few
#: enough that the epoch's tail is shared out finely.
DEFAULT_LEASE = 4
_POLL_S = 0.25


def _call(coordinator_rank: int, worker: int, entry: Callable[..., Any], *args: Any, timeout: float) -> Future[Any]:
    # the chief's own worker calls its coordinator directly, without RPC
    local = worker == coordinator_rank and local_coordinator() is not None
    return call_host(coordinator_rank, entry, *args, local=local, timeout=timeout)


class BatchLease:
    """A worker's lease of batches from the coordinator, and its clock reports.

    At half a lease the worker asks for more without waiting (the answer fills the lease from an RPC
    thread), so it waits only when the lease is empty. A refill carries the worker's clock and acks
    (the batches pushed since); with a bound, the clock is also reported after each push (at most
    one report in flight, later clocks coalescing) and each step is admitted by :meth:`admit`.

    Args:
        rpc_timeout: seconds an RPC to the coordinator may take: more than the coordinator's own
            ``timeout``, so that its error, naming the workers it waited for, arrives first.
        lease: batches to hold (refilled when half are used); a slower worker holds fewer (:attr:`size`).
        max_staleness: the bound ``s`` (``None``: none; then no clock is reported per push and no
            step is gated).
        prefetch: batches the training loop draws ahead of the step it runs (Lightning's one, plus
            ``prefetch_factor x num_workers``): the bound's flow control leases that many on top.
        incarnation: this process's incarnation of the rank (membership runs).
    """

    def __init__(
        self,
        worker: int,
        *,
        coordinator_rank: int = 0,
        rpc_timeout: float,
        lease: int = DEFAULT_LEASE,
        max_staleness: int | None = None,
        prefetch: int = 1,
        incarnation: int = 0,
    ) -> None:
        if lease < 1:
            raise ValueError(f"BatchLease(lease={lease}): expected at least 1 batch")
        self.worker = worker
        self.coordinator_rank = coordinator_rank
        self.rpc_timeout = rpc_timeout
        self.lease = lease
        self.max_staleness = max_staleness
        self.prefetch = prefetch
        self.incarnation = incarnation
        self._known_min: int | None = None  # the others' lowest clock, as a gate last answered
        self._cond = threading.Condition(threading.RLock())  # a local coordinator answers inline
        self._batches: deque[LeasedBatch] = deque()
        self._refill: Future[Any] | None = None
        self._refill_started = 0.0
        self._over = False
        self._stop = False
        self._error: BaseException | None = None
        self._acks: list[tuple[int, int]] = []
        # acks sent in reports not answered yet: a refill carries them again, so that the clock it
        # reports and its unpushed batches agree (the coordinator ignores an ack it has counted)
        self._unconfirmed: list[tuple[int, int]] = []
        self._clock = 0
        self._report: Future[Any] | None = None
        self._report_due = False
        self._taken = 0  # batches drawn in the current loop epoch
        self._loop_epoch: int | None = None  # the loop epoch ``_taken`` counts
        self._pace = 1.0  # this worker's speed over the mean worker's, as the coordinator measures it
        self.offset = 0
        self.lrs: list[float] | None = None
        #: seconds the worker waited for a refill (lease empty), and for the staleness bound (its gate,
        #: or a refill it held)
        self.wait_seconds = 0.0
        self.gate_seconds = 0.0
        #: a refill was held by the bound since the last :meth:`take_held` (pull before training on)
        self._held = False
        self.refills = 0
        self.reports = 0
        #: (this worker's clock at a step, the others' lowest clock when its batch was leased)
        self.admissions: deque[tuple[int, int]] = deque(maxlen=RECORD_LIMIT)

    def _call(self, entry: Callable[..., Any], *args: Any) -> Future[Any]:
        return _call(self.coordinator_rank, self.worker, entry, *args, timeout=self.rpc_timeout)

    def _reply(self, fut: Future[Any], what: str) -> Any:
        where = f"the async coordinator (rank {self.coordinator_rank})"
        return wait_reply(fut, f"worker {self.worker}: {what} {where} failed")

    # -- drawing --------------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """The coordinator ended the run (membership runs)."""
        return self._stop

    def next(
        self, epoch: int, plan: DataPlan, *, limit: int | None = None, should_stop: Callable[[], bool] | None = None
    ) -> LeasedBatch | None:
        """The next batch of this worker's loop epoch ``epoch``, or ``None`` when the epoch is over.

        Args:
            plan: how the epoch is batched (the same on every rank).
            limit: at most this many batches in the epoch (``Trainer(limit_train_batches=n)``).
            should_stop: polled while waiting; when it returns True the wait raises. A failed refill raises
                ``RuntimeError`` / ``TimeoutError``, naming what the coordinator waited for, or the failure.
        """
        with self._cond:
            if epoch != self._loop_epoch:
                # a new loop epoch, also when the last one ended without a draw past its end
                # (Lightning stops at `limit_train_batches` without fetching one batch more)
                if self._loop_epoch is not None and self._taken:
                    self._end_loop_epoch()
                self._loop_epoch = epoch
            start = None
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    if limit is not None and self._taken >= limit:
                        self._end_loop_epoch()
                        return None
                    if self._batches:
                        batch = self._batches.popleft()
                        self._taken += 1
                        self._maybe_refill(epoch, plan, limit)
                        return batch
                    if self._stop or self._over:
                        self._end_loop_epoch()
                        return None
                    if self._refill is None:
                        self._start_refill(epoch, plan, self._want(limit))
                        continue  # a local coordinator may have answered already
                    start = time.perf_counter() if start is None else start
                    self._cond.wait(_POLL_S)
                    if should_stop is not None and should_stop():
                        raise RuntimeError(
                            f"worker {self.worker}: told to stop while waiting for a lease of epoch {epoch} from "
                            f"the async coordinator (rank {self.coordinator_rank})"
                        )
            finally:
                if start is not None:  # the time this call waited for a refill
                    self.wait_seconds += time.perf_counter() - start

    def _end_loop_epoch(self) -> None:
        self._over = False
        self._taken = 0
        self._known_min = None  # the next epoch counts workers that finished this one again

    @property
    def size(self) -> int:
        """``lease`` scaled down for a worker slower than the mean (at least one batch), so that a
        straggler does not keep the epoch's last batches."""
        return max(1, min(self.lease, math.ceil(self.lease * self._pace)))

    def _want(self, limit: int | None) -> int:
        want = self.size - len(self._batches)
        if limit is not None:
            want = min(want, limit - self._taken - len(self._batches))
        return want

    def _maybe_refill(self, epoch: int, plan: DataPlan, limit: int | None) -> None:
        if self._refill is not None or self._over or self._stop or len(self._batches) > self.size // 2:
            return
        want = self._want(limit)
        if want > 0:
            self._start_refill(epoch, plan, want)

    def _start_refill(self, epoch: int, plan: DataPlan, want: int) -> None:
        acks = self._unconfirmed + self._acks
        self._acks = []
        self.refills += 1
        self._refill_started = time.perf_counter()
        fut = self._call(
            _rpc_refill, self.worker, epoch, max(1, want), self._clock, acks, plan, self.incarnation, self.prefetch
        )
        self._refill = fut
        fut.add_done_callback(lambda f: self._on_refill(f, epoch))

    def _on_refill(self, fut: Future[Any], epoch: int) -> None:
        with self._cond:
            if self._refill is not fut:
                return
            self._refill = None
            try:
                reply: LeaseReply = self._reply(fut, f"a lease of epoch {epoch} from")
            except (RuntimeError, TimeoutError) as err:
                self._error = err
                self._cond.notify_all()
                return
            self._batches.extend(reply.batches)
            self._over = self._over or reply.over
            self._stop = self._stop or reply.stop
            self.offset = reply.offset
            self._pace = reply.pace
            if reply.lrs is not None:
                self.lrs = reply.lrs
            if reply.waited > 0 and reply.batches and self.max_staleness is not None:
                self.gate_seconds += min(reply.waited, time.perf_counter() - self._refill_started)
                self._held = True
            self._cond.notify_all()

    def take_held(self) -> bool:
        """Whether the staleness bound held a refill since the last call (then the worker should pull)."""
        with self._cond:
            held, self._held = self._held, False
            return held

    def admit(self, batch: LeasedBatch, clock: int, *, should_stop: Callable[[], bool] | None = None) -> int | None:
        """Admit the step that trains ``batch`` at this worker's ``clock`` under the bound: at once when the
        others' lowest clock known (at its lease, or from the last gate) allows it, else after waiting
        at the coordinator's gate (counted in :attr:`gate_seconds`).

        Returns:
            The step's staleness gap: this worker's clock (in the bound's frame) minus the others'
            lowest clock that admitted it (at most ``max_staleness``); ``None`` without a bound,
            or when no other worker was training.
        """
        if self.max_staleness is None:
            return None
        mine = clock + self.offset
        known = max((x for x in (batch.admitted_min, self._known_min) if x is not None), default=None)
        if batch.admitted_min is not None and (known is None or known < mine - self.max_staleness):
            known = self._wait_gate(mine, should_stop)
        if known is None:
            return None
        self.admissions.append((mine, known))
        return mine - known

    def _wait_gate(self, mine: int, should_stop: Callable[[], bool] | None) -> int | None:
        start = time.perf_counter()
        fut = self._call(_rpc_gate, self.worker, mine, self.incarnation)
        answered = threading.Event()
        fut.add_done_callback(lambda _: answered.set())
        while not answered.wait(_POLL_S):
            if should_stop is not None and should_stop():
                raise RuntimeError(
                    f"worker {self.worker}: told to stop while the staleness gate held step {mine + 1 - self.offset}"
                )
        reply: GateReply = self._reply(fut, f"the staleness gate at clock {mine} of")
        waited = time.perf_counter() - start
        with self._cond:
            self._known_min = reply.min_other
            if reply.waited > 0:
                self.gate_seconds += waited
                self._held = True
        return reply.min_other

    # -- clocks and acks ------------------------------------------------------------------------

    def pushed(self, clock: int, batches: Sequence[LeasedBatch]) -> None:
        """This worker has pushed ``clock`` times, the last push carrying ``batches``."""
        with self._cond:
            self._clock = clock
            self._acks.extend((b.epoch, b.index) for b in batches)
            # with a bound the others wait for this clock; and while a refill is held, its acks are
            # the only way the coordinator learns of the batches pushed meanwhile (with membership,
            # an epoch ends only once every batch is acked)
            if self.max_staleness is not None or (self._refill is not None and self._acks):
                if self._report is None:
                    self._send_report()
                else:
                    self._report_due = True  # coalesced into the next report

    def give_back(self, batches: Sequence[LeasedBatch]) -> None:
        """Return leased batches this worker will not train to the coordinator's queue; waits for the answer."""
        with self._cond:
            fut = self._send_report(returned=[(b.epoch, b.index) for b in batches])
        self._reply(fut, "giving batches back to")

    def _send_report(
        self, *, finished: bool = False, publish: dict[str, Any] | None = None, returned: Sequence[tuple[int, int]] = ()
    ) -> Future[Any]:
        acks, self._acks = self._acks, []
        self._unconfirmed = acks
        self._report_due = False
        self.reports += 1
        fut = self._call(
            _rpc_report, self.worker, self._clock, acks, self.incarnation, finished, publish, list(returned)
        )
        self._report = fut
        fut.add_done_callback(self._on_report)  # a local coordinator has answered already: runs now
        return fut

    def _on_report(self, fut: Future[Any]) -> None:
        with self._cond:
            if self._report is not fut:
                return
            self._report = None
            self._unconfirmed = []
            try:
                self._reply(fut, "reporting its clock to")
            except (RuntimeError, TimeoutError) as err:
                self._error = err
                return
            if self._report_due:
                self._send_report()

    def flush(self, *, finished: bool = True, publish: dict[str, Any] | None = None) -> None:
        """Send the clock and acks and wait for the answer (at an epoch's last step), so the coordinator
        counts every batch of the epoch first; ``finished``: no batch of the epoch left, so the worker no
        longer holds the others back; ``publish``: values for the chief (membership: its buffers)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            pending = self._report
        if pending is not None:
            with contextlib.suppress(Exception):  # its failure is reported below, or was already
                pending.wait()
        with self._cond:
            self._report = None
            fut = self._send_report(finished=finished, publish=publish)
        fut.wait()
        with self._cond:
            if self._error is not None:
                raise self._error

    @property
    def clock(self) -> int:
        """The pushes this worker has reported to the lease."""
        return self._clock


def report_failure(worker: int, reason: str, *, coordinator_rank: int = 0, timeout_s: float = 2.0) -> None:
    """Tell the coordinator that ``worker`` failed, so nothing waits on its clock (with membership, it is
    dropped). Best effort and bounded: the coordinator's host may be gone."""
    with contextlib.suppress(Exception):  # the coordinator's own timeout still bounds every wait
        _call(coordinator_rank, worker, _rpc_fail, worker, reason, timeout=timeout_s).wait()


def join_run(worker: int, incarnation: int, name: str, *, coordinator_rank: int, rpc_timeout: float) -> JoinReply:
    """(Membership) Register this process as ``worker``'s ``incarnation`` with the coordinator."""
    fut = _call(coordinator_rank, worker, _rpc_join, worker, incarnation, name, timeout=rpc_timeout)
    return wait_reply(fut, f"worker {worker}: joining the async run (coordinator rank {coordinator_rank})")


def leave_run(worker: int, incarnation: int, *, coordinator_rank: int, rpc_timeout: float) -> None:
    """(Membership) Tell the coordinator this worker finished and leaves."""
    fut = _call(coordinator_rank, worker, _rpc_leave, worker, incarnation, timeout=rpc_timeout)
    wait_reply(fut, f"worker {worker}: leaving the async run (coordinator rank {coordinator_rank})")


def fetch_published(key: str, *, coordinator_rank: int, worker: int, rpc_timeout: float) -> Any:
    """(Membership) What the chief published under ``key`` (buffers, scheduler states), or ``None``."""
    fut = _call(coordinator_rank, worker, _rpc_published, key, timeout=rpc_timeout)
    return wait_reply(fut, f"worker {worker}: reading {key!r} from the async coordinator (rank {coordinator_rank})")
