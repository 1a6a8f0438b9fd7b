"""The stale-synchronous-parallel (SSP) clocks (Ho et al. 2013): no worker starts step ``c+1``
before every other worker has pushed ``c - s`` times.

The lowest clock of the alive, active workers (one that finished the epoch's batches is inactive
until the next starts) comes from a heap with one entry per clock change: O(log P), no scan.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping

from lightning_strategies.comm.async_.messages import RECORD_LIMIT
from lightning_strategies.comm.async_.workers import WorkerState

__all__ = ["SSPClocks"]


class SSPClocks:
    """Every worker's clock in the bound's frame (``workers`` is shared with the coordinator), and the
    bound ``max_staleness`` (``None``: no bound)."""

    def __init__(self, workers: Mapping[int, WorkerState], max_staleness: int | None, push_every: int) -> None:
        self._workers = workers
        self.max_staleness = max_staleness
        self.push_every = push_every
        self._heap: list[tuple[int, int, int]] = []  # (gate clock, rank, version)
        # (worker, clock in the staleness frame, lowest other clock) at every batch leased under a bound
        self.admissions: deque[tuple[int, int, int]] = deque(maxlen=RECORD_LIMIT)
        # every worker's clock after each change (-1: not alive)
        self.clock_log: deque[tuple[int, ...]] = deque(maxlen=RECORD_LIMIT)
        for w in workers.values():
            self.push(w)

    def push(self, w: WorkerState) -> None:
        w.version += 1
        if w.alive and w.active:
            heapq.heappush(self._heap, (w.gate_clock, w.rank, w.version))
        if len(self._heap) > 4 * len(self._workers) + 16:  # stale entries pile up above the minimum
            self._heap = [(x.gate_clock, x.rank, x.version) for x in self._workers.values() if x.alive and x.active]
            heapq.heapify(self._heap)

    def _clean_top(self) -> None:
        while self._heap:
            _, rank, version = self._heap[0]
            w = self._workers[rank]
            if w.alive and w.active and w.version == version:
                return
            heapq.heappop(self._heap)

    def min_other(self, rank: int) -> int | None:
        """The lowest clock among the other alive, active workers (O(log P))."""
        self._clean_top()
        if not self._heap:
            return None
        if self._heap[0][1] != rank:
            return self._heap[0][0]
        mine = heapq.heappop(self._heap)
        self._clean_top()
        other = self._heap[0][0] if self._heap else None
        heapq.heappush(self._heap, mine)
        return other

    def min_all(self) -> int | None:
        self._clean_top()
        return self._heap[0][0] if self._heap else None

    def credit(self, w: WorkerState) -> tuple[int | None, int | None]:
        """(batches ``w`` may still be leased, the lowest other clock); ``None`` credit: unbounded.

        With ``push_every = k``, the others' lowest clock ``m`` and ``h`` batches leased and not
        pushed, a worker at clock ``c`` gets at most ``(m + s + 1 - c) k - h`` more, so a fast worker
        cannot hoard the queue while it waits.
        """
        if self.max_staleness is None:
            return None, None
        low = self.min_other(w.rank)
        if low is None:
            return None, None  # alone: nobody to wait for
        allowed = (low + self.max_staleness + 1 - w.gate_clock) * self.push_every - len(w.outstanding)
        return allowed, low

    def set_active(self, w: WorkerState, active: bool) -> None:
        if w.active != active:
            w.active = active
            self.push(w)

    def activate_all(self) -> None:
        for w in self._workers.values():
            if w.alive:
                self.set_active(w, True)

    def set_clock(self, w: WorkerState, clock: int) -> bool:
        """Whether ``clock`` moves ``w`` forward (then it is taken)."""
        if clock <= w.clock:
            return False
        w.clock = clock
        self.push(w)
        self.log()
        return True

    def log(self) -> None:
        self.clock_log.append(tuple(w.clock if w.alive and w.active else -1 for _, w in sorted(self._workers.items())))
