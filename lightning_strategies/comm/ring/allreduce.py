"""Ring all-reduce, flat and hierarchical, with byte accounting.

Reduce-scatter then all-gather: every rank sends ``2 (P-1) / P`` of the tensor, whatever P (bandwidth-optimal).
**Hierarchical** (Horovod's), on N nodes of L processes: reduce-scatter inside each node, L rings across the
nodes on an L-th each, all-gather inside: ``2 (N-1) / N x 1/L`` crosses nodes, in 2(N-1) serial steps, not 2(NL-1).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_strategies.comm.ring.check import _validated
from lightning_strategies.comm.ring.layout import NodeLayout
from lightning_strategies.comm.ring.transport import _Ring, _run
from lightning_strategies.comm.stats import CommStats

__all__ = ["hierarchical_all_reduce", "ring_all_reduce"]


def _process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(
            "ring_all_reduce needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first or pass group=..."
        )
    return pg


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    op: str = "sum",
    wire_dtype: str | torch.dtype | None = None,
    check_peers: bool = True,
    segment_bytes: int | None = None,
    layout: NodeLayout | None = None,
) -> CommStats:
    """Reduce ``tensor`` in place across ``group`` with a ring (reduce-scatter, then all-gather).

    Blocks until this rank's result is complete (on CUDA: enqueued on the current stream). Equals
    ``dist.all_reduce`` up to summation order; integer ``"avg"`` truncates toward zero (as NCCL).

    Args:
        tensor: contiguous, of a dtype in :data:`SUPPORTED_DTYPES`, same numel and dtype everywhere.
        group: default the world; a dedicated group when another thread uses the default one.
        op: ``"sum"`` or ``"avg"``.
        wire_dtype: ``"bf16"`` / ``"fp16"`` (or the torch dtypes) to send chunks narrower while accumulating
            in the tensor's dtype; rounded once per hop and once at the end, so all ranks end bit-identical.
        check_peers: first one small all-gather of the call's shape, so a mismatched or bad call raises
            ``ValueError`` on every rank instead of hanging. ``False`` (on every rank) only where agreement
            is guaranteed (the DDP hook).
        segment_bytes: wire bytes per piece on gloo; default 4 MiB, or 2 MiB with a wire dtype.
        layout: the world's :class:`NodeLayout`, to split the byte counts by node (``inter_node_bytes_*``).

    Returns:
        What this rank sent and received (``2 (P-1) / P x numel x wire itemsize``) and its host wall time.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: non-contiguous, bad ``op`` / ``wire_dtype``, a layout of another world, or ranks disagreeing.
        RingPeerError: a neighbour died or stopped answering within the group's timeout.
    """
    start = time.perf_counter()
    pg = _process_group(group)
    world = dist.get_world_size(pg)
    if layout is not None and layout.world != dist.get_world_size():
        raise ValueError(
            f"ring_all_reduce: found a layout of {layout.world} processes in a world of {dist.get_world_size()}: "
            "expected the layout of the whole world (NodeLayout.from_ranks over every rank)."
        )
    wire = _validated(tensor, op, wire_dtype, [pg] if check_peers and world > 1 else [])
    stats = CommStats(calls=1)
    if layout is not None:
        stats.inter_node_bytes_sent = stats.inter_node_bytes_received = 0
    if world > 1 and tensor.numel() > 0:
        cross = (False, False)
        if layout is not None:
            rank = dist.get_rank(pg)
            me, nxt, prev = (layout.node_of(dist.get_global_rank(pg, r % world)) for r in (rank, rank + 1, rank - 1))
            cross = (nxt != me, prev != me)
        wire = None if wire == tensor.dtype else wire
        flat = tensor.view(-1)
        ring = _Ring(flat, pg, stats, divisor=world if op == "avg" else 1, wire=wire, cross=cross)
        _run(ring, segment_bytes)
    stats.seconds = time.perf_counter() - start
    return stats


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    intra_group: dist.ProcessGroup,
    inter_group: dist.ProcessGroup,
    *,
    op: str = "sum",
    wire_dtype: str | torch.dtype | None = None,
    check_peers: bool = True,
    segment_bytes: int | None = None,
) -> CommStats:
    """Reduce ``tensor`` in place over N nodes of L processes: ring inside, ring across, ring inside.

    Bit-identical everywhere (with a wire dtype: ``(L-1) + (N-1)`` roundings at most); ``"avg"`` divides by
    N x L. With N = 1 or L = 1 it is the flat ring over the other group.

    Args:
        tensor, op, wire_dtype, check_peers, segment_bytes: as :func:`ring_all_reduce`.
        intra_group: this process's node (:func:`new_hierarchical_groups`).
        inter_group: this process's local rank on every node, in node order.

    Returns:
        This process's bytes, ``inter_node_bytes_*`` being ``2 (N-1)/N x numel/L x itemsize``.

    Raises:
        TypeError, ValueError, RingPeerError: as :func:`ring_all_reduce`.
    """
    start = time.perf_counter()
    local, nodes = dist.get_world_size(intra_group), dist.get_world_size(inter_group)
    wire = _validated(tensor, op, wire_dtype, [intra_group, inter_group] if check_peers and local * nodes > 1 else [])
    stats = CommStats(calls=1, inter_node_bytes_sent=0, inter_node_bytes_received=0)
    if local * nodes > 1 and tensor.numel() > 0:
        wire = None if wire == tensor.dtype else wire
        flat = tensor.view(-1)
        divisor = local * nodes if op == "avg" else 1
        if nodes == 1 or local == 1:
            across = nodes > 1
            pg = inter_group if across else intra_group
            _run(_Ring(flat, pg, stats, divisor=divisor, wire=wire, cross=(across, across)), segment_bytes)
        else:
            inside = _Ring(flat, intra_group, stats, divisor=1, wire=wire, stop=local - 1, round_owner=False)
            _run(inside, segment_bytes)
            a, b = inside.chunks[(inside.rank + 1) % local]  # the chunk this process now owns for its node
            if b > a:  # the same chunk index on every node: all empty (numel < L) or none
                _run(_Ring(flat[a:b], inter_group, stats, divisor=divisor, wire=wire, cross=(True, True)),
                     segment_bytes)  # fmt: skip
            _run(_Ring(flat, intra_group, stats, divisor=1, wire=wire, first=local - 1), segment_bytes)
    stats.seconds = time.perf_counter() - start
    return stats
