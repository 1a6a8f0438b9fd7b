"""The fault-tolerant step: average tensors over the quorum, then commit only if every replica may.

torchft's ``DistributedDataParallel`` asserts in its communication hook when a peer dies inside
the all-reduce, failing the survivor too. Here the all-reduce is a plain
``manager.allreduce(flat).wait()`` on a copy of the tensors, followed by
``manager.should_commit()``: an error marks the step, the step does not commit, the copy is
dropped and the local tensors are intact, so the same step is tried again on a new quorum (the
dead peer out of it, after the Lighthouse's heartbeat timeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CommitFailedError", "CommitStats", "average_and_commit", "flatten", "unflatten_into"]


class CommitFailedError(RuntimeError):
    """A step was not committed in any of its attempts."""


@dataclass
class CommitStats:
    """What one committed step cost.

    Attributes:
        attempts: all-reduces tried (1 when nothing failed).
        participants: replicas in the quorum that committed.
        bytes: payload bytes handed to the all-reduces (all attempts).
        seconds: wall time from the first all-reduce to the commit, new quorums included.
        healed: a new quorum of a retry healed this replica.
    """

    attempts: int = 0
    participants: int = 0
    bytes: int = 0
    seconds: float = 0.0
    healed: bool = False


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new 1-D tensor holding ``tensors`` one after the other (in ``dtype`` if given)."""
    if not tensors:
        raise ValueError("flatten found no tensors: expected at least one. Fix: pass the parameters' tensors.")
    out_dtype = dtype or tensors[0].dtype
    return torch.cat([t.detach().reshape(-1).to(out_dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the consecutive pieces of ``flat`` into ``tensors`` (cast to each one's dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"unflatten_into found {flat.numel()} values for tensors of {offset}: expected equal.")


def average_and_commit(
    manager: Any,
    tensors: Callable[[], Sequence[torch.Tensor]],
    *,
    attempts: int,
    requorum: Callable[[], bool],
    wire_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, CommitStats]:
    """Average ``tensors()`` over the current quorum and commit; on failure, try again on a new one.

    The quorum of the first attempt must have been started by the caller. Each attempt flattens
    ``tensors()`` anew (a retry after a heal may hand different ones), all-reduces the copy with
    ``manager.allreduce(...).wait()`` and asks ``manager.should_commit()``.

    Args:
        manager: the replica's ``torchft.manager.Manager``.
        tensors: the local tensors to average, called once per attempt.
        attempts: all-reduces to try before giving up (>= 1).
        requorum: starts a new quorum before a retry; returns whether it healed this replica.
        wire_dtype: the all-reduce's dtype (``torch.bfloat16`` halves the bytes), else the tensors'.

    Returns:
        The averaged values, flat (in ``wire_dtype``), and the step's :class:`CommitStats`.

    Raises:
        CommitFailedError: no attempt committed.
    """
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: expected >= 1. Fix: pass attempts=3.")
    stats = CommitStats()
    start = time.perf_counter()
    for attempt in range(attempts):
        if attempt:
            stats.healed |= requorum()
        flat = flatten(tensors(), wire_dtype)
        stats.attempts += 1
        stats.bytes += flat.numel() * flat.element_size()
        manager.allreduce(flat).wait()  # errors are swallowed and reported to should_commit
        if manager.should_commit():
            stats.participants = int(manager.num_participants())
            stats.seconds = time.perf_counter() - start
            return flat, stats
    raise CommitFailedError(
        f"found no committed step in {attempts} attempts (the last error: {manager.errored()}): expected a quorum "
        f"of at least min_replicas replicas whose all-reduce completes. Fix: check that enough replicas run and "
        "reach the Lighthouse, or raise commit_attempts / timeout."
    )
