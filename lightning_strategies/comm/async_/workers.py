"""The coordinator's record of each worker, and of a request it holds (a refill or a gate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.futures import Future

__all__ = ["Held", "WorkerState"]


@dataclass
class Held:
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
class WorkerState:
    """One worker as the coordinator sees it: its clock, its leased batches, its held requests."""

    rank: int
    incarnation: int = 0
    name: str = ""
    alive: bool = True
    clock: int = 0
    offset: int = 0
    # (epoch, index) leased to this worker and not acked yet
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    pending: Held | None = None
    gate: Held | None = None
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

    def held(self) -> list[Held]:
        """Its requests still waiting for an answer."""
        return [p for p in (self.pending, self.gate) if p is not None and not p.done]
