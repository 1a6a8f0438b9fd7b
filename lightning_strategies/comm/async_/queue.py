"""The coordinator's batch queue: each epoch's batches, leased by speed, acked once, put back.

A worker takes at most half its share (by batches acked per second) of what is left, so an epoch's
tail is spread over the workers instead of sitting in a slow worker's lease.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_strategies.comm.async_.clocks import SSPClocks
from lightning_strategies.comm.async_.messages import DataPlan, LeasedBatch
from lightning_strategies.comm.async_.workers import WorkerState

__all__ = ["BatchQueue", "Epoch"]


@dataclass
class Epoch:
    """One data epoch's batches and who leased and acked them."""

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


class BatchQueue:
    """The epochs' queues and the workers' speeds (not thread-safe: the coordinator's lock guards it)."""

    def __init__(self, workers: Mapping[int, WorkerState], clocks: SSPClocks) -> None:
        self._workers = workers
        self._clocks = clocks
        self.epochs: dict[int, Epoch] = {}
        self.batches_redrawn = 0
        self.batches_returned = 0
        self._rate_sum = 0.0  # over the alive workers with a measured rate
        self._rated = 0

    def open(self, epoch: int, plan: DataPlan, alive: int) -> None:
        batches = plan.batches(epoch)
        self.epochs[epoch] = Epoch(epoch, plan, batches, deque(range(len(batches))), {}, alive)
        self._clocks.activate_all()
        for old in [e for e in self.epochs if e < epoch - 2 and self.epochs[e].complete]:
            del self.epochs[old]  # keep the last few epochs' accounting for inspection

    def later_epoch_open(self, w: WorkerState) -> bool:
        """Whether an epoch after the last one ``w`` was leased batches of is open."""
        mine = [e.number for e in self.epochs.values() if e.served.get(w.rank, 0) > 0]
        return bool(mine) and any(number > max(mine) for number in self.epochs)

    def take_acks(self, w: WorkerState, acks: Iterable[tuple[int, int]]) -> None:
        new = 0
        for key in acks:
            epoch, index = int(key[0]), int(key[1])
            if (epoch, index) in w.outstanding:
                w.outstanding.discard((epoch, index))
                new += 1
            known = self.epochs.get(epoch)
            if known is not None and index not in known.done:
                known.done[index] = w.rank  # the first ack counts it; a redrawn copy's ack does not
        if new:
            now = time.monotonic()
            if w.last_ack is not None and now > w.last_ack:
                sample = new / (now - w.last_ack)
                self.set_rate(w, sample if w.rate is None else 0.5 * w.rate + 0.5 * sample)
            w.last_ack = now

    def set_rate(self, w: WorkerState, rate: float | None) -> None:
        if w.rate is not None:
            self._rate_sum -= w.rate
            self._rated -= 1
        w.rate = rate
        if rate is not None:
            self._rate_sum += rate
            self._rated += 1

    def share(self, w: WorkerState, alive: int) -> float:
        """``w``'s share of the ``alive`` workers' speed (equal shares until speeds are measured)."""
        alive = max(1, alive)
        if not self._rated or w.rate is None:
            return 1.0 / alive
        mean = self._rate_sum / self._rated
        total = self._rate_sum + (alive - self._rated) * mean
        return w.rate / total if total > 0 else 1.0 / alive

    def joined(self, rank: int) -> None:
        for known in self.epochs.values():
            known.undrawn += int(known.served.get(rank, 0) == 0)

    def dropped(self, w: WorkerState) -> None:
        self.set_rate(w, None)
        for known in self.epochs.values():
            if known.served.get(w.rank, 0) == 0:
                known.undrawn -= 1  # nothing to keep for it any more
        self.requeue(w, list(w.outstanding), redrawn=True)

    def requeue(self, w: WorkerState, batches: list[tuple[int, int]], *, redrawn: bool) -> None:
        for epoch, index in sorted(batches, reverse=True):
            if (epoch, index) not in w.outstanding:
                continue
            w.outstanding.discard((epoch, index))
            held = self.epochs.get(epoch)
            if held is not None and index not in held.done:
                held.queue.appendleft(index)
                if redrawn:
                    held.redrawn.append(index)
                    self.batches_redrawn += 1
                else:
                    self.batches_returned += 1

    def lease(self, w: WorkerState, sources: list[tuple[Epoch, int]], n: int, low: int | None) -> list[LeasedBatch]:
        """Up to ``n`` batches for ``w`` from ``sources`` ((epoch, batches it may give), in order)."""
        leased: list[LeasedBatch] = []
        if n > 0:
            self._clocks.set_active(w, True)  # it has batches of the epoch to train: it counts
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

    def served(self, epoch: int, ranks: list[int]) -> list[int]:
        known = self.epochs.get(epoch)
        return [known.served.get(r, 0) if known else 0 for r in ranks]

    def remaining(self, epoch: int) -> int:
        known = self.epochs.get(epoch)
        return len(known.queue) if known is not None else 0

    def accounting(self, epoch: int) -> dict[str, Any]:
        known = self.epochs.get(epoch)
        if known is None:
            return {"num_batches": 0, "done": {}, "redrawn": []}
        return {"num_batches": len(known.batches), "done": dict(known.done), "redrawn": list(known.redrawn)}

    def done_count(self, epoch: int) -> int:
        known = self.epochs.get(epoch)
        return len(known.done) if known is not None else 0
