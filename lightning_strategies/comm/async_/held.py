"""The requests the coordinator holds (refills short of credit or of work, staleness gates): one heap
keyed by the lowest clock that opens each, so a clock change retries only those it opens (no O(P^2))."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from torch.futures import Future

from lightning_strategies.comm.async_.chief import Chief
from lightning_strategies.comm.async_.clocks import SSPClocks
from lightning_strategies.comm.async_.messages import GateReply, LeaseReply
from lightning_strategies.comm.async_.queue import BatchQueue, Epoch
from lightning_strategies.comm.async_.watchdog import DeadlineWatchdog
from lightning_strategies.comm.async_.workers import Held, WorkerState
from lightning_strategies.comm.rpc import ShardError

__all__ = ["HeldRequests", "Ready", "Sources"]

#: A future and the value to set on it, outside the coordinator's lock (its callbacks send the reply).
Ready = tuple[Future[Any], Any]


class Sources(Protocol):
    """Where a refill's batches come from, and how long a held request waits (the membership)."""

    patience: float
    alive_count: int

    def sources(self, w: WorkerState, held: Held) -> list[tuple[Epoch, int]] | None: ...


@dataclass(eq=False)
class HeldRequests:
    """Answers refills and gates now or holds them (not thread-safe: the coordinator's lock guards it)."""

    workers: dict[int, WorkerState]
    clocks: SSPClocks
    queue: BatchQueue
    members: Sources
    watchdog: DeadlineWatchdog
    board: Chief
    timeout: timedelta
    _waiting: list[tuple[int, int, Held]] = field(default_factory=list)  # heap of (need, seq, request held on credit)
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def new(self, worker: int, fut: Future[Any], **fields: Any) -> Held:
        now = time.monotonic()
        deadline = now + self.timeout.total_seconds() * self.members.patience
        return Held(worker, fields.pop("epoch", -1), fields.pop("want", 0), now, fut, deadline, **fields)

    def answer(self, w: WorkerState, held: Held) -> LeaseReply | None:
        """The answer to ``held`` if it can be given now (holding the lock), else ``None``."""
        if self.board.stopped:
            return LeaseReply([], over=True, stop=True, offset=w.offset, lrs=self.board.lrs)
        sources = self.members.sources(w, held)
        if sources is None:
            return None  # membership: no work yet
        if not sources:
            return LeaseReply([], over=True, waited=self._waited(held), offset=w.offset, lrs=self.board.lrs)
        credit, low = self.clocks.credit(w)
        available = sum(n for _, n in sources)
        alive = self.members.alive_count
        n = min(held.want, available, max(1, math.ceil(available * self.queue.share(w, alive) / 2)))
        if credit is not None:
            credit += held.prefetch
            if credit <= 0:
                held.credit_held = True
                assert self.clocks.max_staleness is not None
                # credit reappears once the lowest other clock reaches this
                beyond = len(w.outstanding) - held.prefetch
                held.need = w.gate_clock - self.clocks.max_staleness + beyond // self.clocks.push_every
                return None
            n = min(n, credit)
        leased = self.queue.lease(w, sources, n, low)
        pace = self.queue.share(w, alive) * max(1, alive)
        return LeaseReply(leased, waited=self._waited(held), offset=w.offset, lrs=self.board.lrs, pace=pace)

    @staticmethod
    def _waited(held: Held) -> float:
        return time.monotonic() - held.start if held.credit_held or held.done else 0.0

    def empty_reply(self, w: WorkerState, held: Held) -> LeaseReply:
        return LeaseReply([], waited=time.monotonic() - held.start, offset=w.offset, lrs=self.board.lrs)

    def hold(self, w: WorkerState, held: Held) -> None:
        """Hold a refill or a gate (a gate is always held on credit) until it can be answered or times out."""
        if held.gate:
            if w.gate is not None and not w.gate.done:
                w.gate.done = True  # replaced: its worker gave up on it
            w.gate = held
        else:
            w.pending = held
        if held.credit_held:
            w.held_refills += 1
            heapq.heappush(self._waiting, (held.need, next(self._seq), held))
        self.watchdog.watch(held)

    def release_credit(self) -> list[Ready]:
        """Answer the requests held on credit that the current lowest clock opens (holding the lock)."""
        ready: list[Ready] = []
        low = self.clocks.min_all()
        while self._waiting and (low is None or self._waiting[0][0] <= low):
            _, _, held = heapq.heappop(self._waiting)
            ready += self.retry(held)
            low = self.clocks.min_all()
        return ready

    def retry(self, held: Held) -> list[Ready]:
        """Try a held refill or gate again (holding the lock): its answer, or it is held again."""
        w = self.workers[held.worker]
        if held.gate:
            return self._retry_gate(w, held)
        if held.done or w.pending is not held:
            return []
        held.credit_held = False
        answer = self.answer(w, held)
        if answer is None:
            if held.credit_held:  # still short of credit: wait for a higher clock
                heapq.heappush(self._waiting, (held.need, next(self._seq), held))
            return []
        answer.waited = time.monotonic() - held.start
        w.wait_seconds += answer.waited if self.clocks.max_staleness is not None else 0.0
        held.done = True
        w.pending = None
        return [(held.future, answer)]

    def _retry_gate(self, w: WorkerState, held: Held) -> list[Ready]:
        if held.done or w.gate is not held:
            return []
        low = self.clocks.min_other(w.rank)
        if low is not None and low < held.need:
            heapq.heappush(self._waiting, (held.need, next(self._seq), held))
            return []
        waited = time.monotonic() - held.start
        w.wait_seconds += waited
        held.done = True
        w.gate = None
        if low is not None:
            self.clocks.admissions.append((w.rank, held.need + (self.clocks.max_staleness or 0), low))
        return [(held.future, GateReply(low, waited))]

    def retry_all(self) -> list[Ready]:
        """Try every held request again (an epoch opened, work was put back, the run stopped)."""
        ready: list[Ready] = []
        for w in self.workers.values():
            for held in w.held():
                ready += self.retry(held)
        return ready

    @staticmethod
    def take(w: WorkerState) -> list[Held]:
        """``w``'s requests still held, each marked answered (holding the lock)."""
        held = w.held()
        for h in held:
            h.done = True
        w.pending = w.gate = None
        return held

    def take_all(self) -> list[Held]:
        """Every request still held, each marked answered (holding the lock)."""
        self._waiting.clear()
        return [h for w in self.workers.values() for h in self.take(w)]

    def timeout_error(self, held: Held) -> ShardError:
        seconds = self.timeout.total_seconds()
        if not held.credit_held:
            message = (
                f"worker {held.worker} waited {seconds:.0f}s for batches: no epoch was opened and none was "
                "redrawn (the chief validating or checkpointing for longer than `timeout`?). To wait longer, raise "
                "the strategy's `timeout`."
            )
        else:
            mine, s = self.workers[held.worker].gate_clock, self.clocks.max_staleness
            behind = {
                r: x.gate_clock
                for r, x in self.workers.items()
                if r != held.worker and x.alive and x.gate_clock < held.need
            }
            message = (
                f"worker {held.worker} (clock {mine}) waited {seconds:.0f}s for worker(s) {sorted(behind)} "
                f"(clocks {list(behind.values())}) to push step {held.need} (max_staleness={s}). "
                f"Worker(s) {sorted(behind)} died or are stuck; check their logs. To wait longer for slow workers, "
                "raise the strategy's `timeout`."
            )
        return ShardError(message, timed_out=True)
