"""What the async coordinator and its workers exchange: the data plan, leased batches, replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RECORD_LIMIT", "DataPlan", "GateReply", "JoinReply", "LeaseReply", "LeasedBatch", "ReportReply"]

# Records kept for inspection (tests, logs), bounded so a long run's memory stays flat (~1.3 MB per kind)
RECORD_LIMIT = 10_000


@dataclass(frozen=True)
class DataPlan:
    """How an epoch's samples become batches; every worker must send the same plan.

    Attributes:
        drop_last: drop the last batch when it is short (as ``DataLoader(drop_last=True)``).
        shuffle: a fresh permutation every epoch (seeded by ``seed + epoch``), else in order.
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
    """One batch of a lease: batch ``index`` of data epoch ``epoch`` (:meth:`DataPlan.batches`), whose
    samples are ``indices``.

    Attributes:
        epoch: under membership it may be trained in a later loop epoch.
        admitted_min: the others' lowest clock (in the staleness frame) when it was leased, which the
            worker checks its own clock against at the step (``None``: no bound or no other worker).
    """

    epoch: int
    index: int
    indices: list[int]
    admitted_min: int | None = None


@dataclass
class LeaseReply:
    """The coordinator's answer to a refill.

    Attributes:
        over: no further batch of this worker's loop epoch: its epoch ends once its lease is used.
        stop: the run is over (membership runs: the chief closed it).
        waited: seconds the refill was held (staleness credit, or no work yet).
        offset: added to this worker's clock in the bound (a joined worker starts at the others' lowest).
        lrs: the chief's learning rates, per param group (membership runs).
        pace: the worker's speed over the mean worker's: a slow worker holds a smaller lease.
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
        state: what the chief published for joiners (:meth:`AsyncCoordinator.publish`).
    """

    epoch: int
    offset: int
    lrs: list[float] | None
    state: dict[str, Any]
