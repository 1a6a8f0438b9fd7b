"""The ring all-reduce's two halves on their own: reduce-scatter, then (after some work on the owned chunk)
all-gather.

After the reduce-scatter rank ``r`` of ``P`` holds the reduced chunk ``(r + 1) % P`` of the flat tensor
(:func:`owned_chunk`; the chunks as even as the element count allows), and the all-gather sends each rank's
owned chunk to every other rank. Together they move exactly what :func:`ring_all_reduce` moves, and between
them each rank may change its owned chunk, e.g. step an optimizer on it: a parameter server whose shards
sit where the ring's chunks do (:mod:`lightning_strategies.comm.ps.ring_shards`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_strategies.comm.ring.transport import _chunk_bounds, _Ring, _run
from lightning_strategies.comm.stats import CommStats

__all__ = ["owned_chunk", "ring_all_gather", "ring_reduce_scatter"]


def owned_chunk(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The range ``[start, end)`` of a flat tensor of ``numel`` elements that rank ``rank`` of ``world`` holds
    reduced after :func:`ring_reduce_scatter` (and sends in :func:`ring_all_gather`)."""
    if not 0 <= rank < world:
        raise ValueError(f"owned_chunk: found rank {rank} of a world of {world}: expected 0 <= rank < world.")
    return _chunk_bounds(numel, world)[(rank + 1) % world]


def _flat(tensor: torch.Tensor, who: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{who}: found a non-contiguous tensor of shape {tuple(tensor.shape)}: expected a contiguous one, "
            "since the ring sends ranges of its flat storage. Fix: pass tensor.contiguous() (and copy back)."
        )
    return tensor.view(-1)


def ring_reduce_scatter(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    average: bool = True,
    divisor: int | None = None,
    stats: CommStats | None = None,
) -> CommStats:
    """Reduce ``tensor`` (summed, or averaged over the group) into this rank's :func:`owned_chunk`, in place.

    The rest of ``tensor`` is left holding partial sums. Every rank of ``group`` must call it with a tensor of
    the same numel and dtype (no check: the callers' plans agree by construction).

    Args:
        tensor: contiguous, floating point.
        group: used by the calling thread alone while the call runs.
        average: divide the owned chunk's sum by the group's size.
        divisor: divide the owned chunk's sum by this instead (a sum that is part of a larger one: the
            hierarchical push's ring across nodes divides by every process of the job, ``N x L``).
        stats: add the bytes and time to these (default: new ones).

    Returns:
        ``stats``: ``(P-1)/P x numel x itemsize`` sent and received.

    Raises:
        RingPeerError: a neighbour died or stopped answering within the group's timeout.
    """
    if divisor is not None and divisor < 1:
        raise ValueError(f"ring_reduce_scatter: found divisor={divisor}: expected a positive count (or None).")
    if divisor is None:
        divisor = dist.get_world_size(group) if average else 1
    return _half(tensor, group, stats, divisor=divisor)


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, *, stats: CommStats | None = None) -> CommStats:
    """Send this rank's :func:`owned_chunk` of ``tensor`` to every rank of ``group`` and receive theirs, in
    place: afterwards every rank holds every rank's owned chunk.

    Args and raises as :func:`ring_reduce_scatter`.
    """
    return _half(tensor, group, stats, divisor=None)


def _half(tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, *, divisor: int | None) -> CommStats:
    """The reduce-scatter (``divisor``: what the owned sum is divided by), or with ``None`` the all-gather."""
    start = time.perf_counter()
    stats = stats if stats is not None else CommStats()
    stats.calls += 1
    world = dist.get_world_size(group)
    flat = _flat(tensor, "ring_all_gather" if divisor is None else "ring_reduce_scatter")
    if world > 1 and flat.numel() > 0:
        if divisor is not None:
            _run(_Ring(flat, group, stats, divisor=divisor, wire=None, stop=world - 1), None)
        else:
            _run(_Ring(flat, group, stats, divisor=1, wire=None, first=world - 1), None)
    elif divisor is not None and divisor > 1 and flat.numel() > 0:  # one process: the sum is its own
        flat.div_(divisor)
    stats.seconds += time.perf_counter() - start
    return stats
