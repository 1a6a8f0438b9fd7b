"""The sharding plan: which elements of the flattened parameters each shard holds.

Elementwise optimizers get equal contiguous ranges (:func:`partition_parameters`), or equal ranges of each
push bucket (:func:`partition_per_group`, BytePS-style);
a layer-wise optimizer (LAMB, LARS) gets whole tensors (:func:`shard_parameters`). A plan depends
only on the sizes, so every rank computes the same one without talking.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "PARTITION_ALIGN",
    "Slice",
    "as_slice",
    "partition_loads",
    "partition_parameters",
    "partition_per_group",
    "shard_loads",
    "shard_parameters",
    "whole_tensor_slices",
]


class Slice(NamedTuple):
    """Elements ``[start, stop)`` of flattened tensor ``tensor`` (optimizer order); held flat unless whole."""

    tensor: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


# Partition boundaries inside a tensor fall on multiples of this many elements from the tensor's
# start, so a slice's elements sit in the same lanes of the CPU's vector loops as in the whole
# tensor (the elementwise optimizer kernels then round exactly as on one device).
PARTITION_ALIGN = 64


def partition_parameters(sizes: Sequence[int], num_servers: int, *, align: int = PARTITION_ALIGN) -> list[list[Slice]]:
    """Split the ``N = sum(sizes)`` flattened elements into ``num_servers`` contiguous ranges, cut at
    ``s * N / num_servers`` snapped to a multiple of ``align`` inside the tensor it falls in: a tensor
    may span servers, and each server's elements differ from ``N / S`` by at most ``align``.

    Args:
        sizes: elements of each tensor, in the optimizer's parameter order.
        align: granularity of a cut inside a tensor, in elements.

    Returns:
        For each shard, its slices in flat order (a zero-size tensor whole, where its offset falls);
        a shard may be empty when ``N < num_servers * align``.

    Raises:
        ValueError: when ``num_servers`` or ``align`` < 1, or a size is negative.
    """
    _check_plan_args(sizes, num_servers)
    if align < 1:
        raise ValueError(f"align must be >= 1 element, found {align}")
    starts = list(itertools.accumulate(sizes, initial=0))
    total = starts[-1]

    def snap(t: int) -> int:
        j = bisect.bisect_right(starts, t) - 1  # the tensor holding element t (t < total): not empty
        off = t - starts[j]
        down = off - off % align
        up = min(down + align, sizes[j])
        return starts[j] + (down if off - down <= up - off else up)

    cuts = [0]
    for s in range(1, num_servers):
        ideal = (s * total + num_servers // 2) // num_servers  # s * N / S, rounded
        cuts.append(max(cuts[-1], snap(ideal) if ideal < total else total))
    cuts.append(total)
    plan: list[list[Slice]] = [[] for _ in range(num_servers)]
    for i, n in enumerate(sizes):
        lo, hi = starts[i], starts[i] + n
        if n == 0:
            plan[min(bisect.bisect_right(cuts, lo) - 1, num_servers - 1)].append(Slice(i, 0, 0))
            continue
        first = bisect.bisect_right(cuts, lo) - 1
        for s in range(first, num_servers):
            a, b = max(lo, cuts[s]), min(hi, cuts[s + 1])
            if a >= hi:
                break
            if a < b:
                plan[s].append(Slice(i, a - lo, b - lo))
    return plan


def partition_per_group(
    sizes: Sequence[int], groups: Sequence[Sequence[int]], num_servers: int, *, align: int = PARTITION_ALIGN
) -> list[list[Slice]]:
    """:func:`partition_parameters` applied to each group of tensors on its own: every shard holds about
    ``1/num_servers`` of every group. With the overlapped push's buckets as the groups, every shard gets
    its part of a bucket at the same time, so all shards complete a bucket together (BytePS' partition of
    every tensor over the servers) instead of one shard waiting for the last bucket alone.

    Args:
        sizes: elements of each tensor, in the optimizer's parameter order.
        groups: the tensor indices of each group; together every index exactly once.

    Returns:
        For each shard, its slices in flat order.

    Raises:
        ValueError: when the groups do not cover every tensor exactly once, or for the arguments
            :func:`partition_parameters` refuses.
    """
    _check_plan_args(sizes, num_servers)
    flat = sorted(i for group in groups for i in group)
    if flat != list(range(len(sizes))):
        raise ValueError(
            f"groups {[list(g) for g in groups]} over {len(sizes)} tensors: expected every tensor index in "
            f"[0, {len(sizes)}) in exactly one group"
        )
    plan: list[list[Slice]] = [[] for _ in range(num_servers)]
    for group in groups:
        members = sorted(group)
        for s, slices in enumerate(partition_parameters([sizes[i] for i in members], num_servers, align=align)):
            plan[s] += [Slice(members[sl.tensor], sl.start, sl.stop) for sl in slices]
    return [sorted(slices) for slices in plan]


def whole_tensor_slices(plan: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[list[Slice]]:
    """A whole-tensor plan (:func:`shard_parameters`) as slices, one per tensor."""
    return [[Slice(i, 0, sizes[i]) for i in shard] for shard in plan]


def partition_loads(plan: Sequence[Sequence[Slice]]) -> list[int]:
    """Elements held by each shard of a partition."""
    return [sum(sl.numel for sl in shard) for shard in plan]


def _check_plan_args(sizes: Sequence[int], num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, found {num_servers}; pass a positive shard count")
    if any(s < 0 for s in sizes):
        raise ValueError(f"tensor sizes must be >= 0, found {[s for s in sizes if s < 0]}")


def shard_parameters(sizes: Sequence[int], num_servers: int) -> list[list[int]]:
    """Assign whole tensors to shards, largest first, each to the shard with the fewest elements so far.

    The busiest shard holds at most ``4/3`` of the optimum and ``mean + largest tensor`` (on ResNet-50
    at 64 shards ~6x the mean: one tensor holds 2.36M of 25.6M elements).

    Args:
        sizes: elements of each tensor, in the optimizer's parameter order.

    Returns:
        For each shard, the sorted indices (into ``sizes``) of its tensors; empty when there are fewer
        tensors than shards.

    Raises:
        ValueError: when ``num_servers`` < 1 or a size is negative.
    """
    _check_plan_args(sizes, num_servers)
    loads = [0] * num_servers
    plan: list[list[int]] = [[] for _ in range(num_servers)]
    for idx in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(num_servers), key=lambda s: (loads[s], s))
        plan[target].append(idx)
        loads[target] += sizes[idx]
    return [sorted(p) for p in plan]


def shard_loads(sizes: Sequence[int], plan: Sequence[Sequence[int]]) -> list[int]:
    """Elements held by each shard of a whole-tensor ``plan``."""
    return [sum(sizes[i] for i in shard) for shard in plan]


def as_slice(item: Slice | int, numel: int) -> Slice:
    """A :class:`Slice`; a bare tensor index means the whole tensor of ``numel`` elements."""
    return item if isinstance(item, Slice) else Slice(int(item), 0, numel)
