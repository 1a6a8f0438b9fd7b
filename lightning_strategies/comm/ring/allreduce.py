"""Ring all-reduce, flat and hierarchical, with byte accounting.

The tensor is cut into P chunks (P = group size). In the *reduce-scatter* phase every rank
sends one chunk to its successor and adds the chunk it receives from its predecessor, P-1
times, after which rank ``r`` holds the full sum of chunk ``(r + 1) % P``. In the
*all-gather* phase the reduced chunks travel once more around the ring (P-1 steps) and
overwrite the stale copies. Every rank therefore sends ``2 (P-1) / P`` of the tensor, less
than twice the tensor however many ranks there are: no link carries more, which is why the
ring is bandwidth-optimal.

**Hierarchical** (:func:`hierarchical_all_reduce`, Horovod's hierarchical all-reduce): on N nodes of
L processes, a reduce-scatter ring inside each node, then L rings across the nodes, one per local
rank, each on its L-th, then an all-gather ring inside each node. Every process sends
``2 (L-1) / L`` of the tensor to its own node and only ``2 (N-1) / N x 1/L`` of it to other
nodes, and the serial steps that cross nodes drop from 2(NL-1) to 2(N-1).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_strategies.comm.ring.check import _check_peers, _check_peers_hierarchical, _validated
from lightning_strategies.comm.ring.layout import NodeLayout
from lightning_strategies.comm.ring.transport import _make_ring, _run
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

    Blocks until this rank's result is complete (on CUDA: until it is enqueued on the current
    stream). Equals ``dist.all_reduce`` up to summation order. Integer ``"avg"`` divides the sum
    with truncation toward zero (C / NCCL semantics).

    Args:
        tensor: contiguous tensor of a dtype in :data:`SUPPORTED_DTYPES`, same numel and dtype
            on every rank.
        group: process group (default: the world group). Use a dedicated group when another
            thread issues collectives on the default one.
        op: ``"sum"`` or ``"avg"``.
        wire_dtype: ``torch.bfloat16`` / ``torch.float16`` (or ``"bf16"`` / ``"fp16"``) to send
            chunks in that narrower type while accumulating in the tensor's own dtype; partial
            sums are rounded once per hop, and the final values are rounded once on every rank
            (owner included) so all ranks end bit-identical. ``None`` sends the tensor's dtype.
        check_peers: exchange (numel, dtype, op, wire dtype, input ok) with one small
            all-gather first, so a mismatched or bad call raises a ``ValueError`` on every rank
            instead of hanging. Pass ``False`` only where the caller guarantees agreement (the
            DDP hook: DDP verifies parameter shapes across ranks and builds identical buckets);
            all ranks must pass the same value.
        segment_bytes: wire bytes per piece a chunk is sent in on gloo (the pipelining
            granularity); default 4 MiB, or 2 MiB with a wire dtype.
        layout: the world's :class:`NodeLayout`, to split the byte counts by node (the
            returned stats' ``inter_node_bytes_sent`` / ``_received``: what went to / came from
            the neighbour when it runs on another node); ``None`` leaves them unsplit.

    Returns:
        What this rank sent, received and how long the call took (host wall time). ``bytes_sent``
        is ``2 (P-1) / P x numel x wire itemsize`` up to two elements of uneven chunking.

    Raises:
        TypeError: ``tensor`` is not a tensor, or of an unsupported dtype.
        ValueError: non-contiguous tensor, bad ``op`` or ``wire_dtype``, a layout of another
            world, or (with ``check_peers``) ranks disagreeing on the call.
        RingPeerError: a neighbour died or stopped answering within the group's timeout
            (``peer`` is its rank in ``group``).
    """
    start = time.perf_counter()
    pg = _process_group(group)
    world = dist.get_world_size(pg)
    if layout is not None and layout.world != dist.get_world_size():
        raise ValueError(
            f"ring_all_reduce: found a layout of {layout.world} processes in a world of {dist.get_world_size()}: "
            "expected the layout of the whole world (NodeLayout.from_ranks over every rank)."
        )
    wire, problem = _validated(tensor, op, wire_dtype)
    if check_peers and world > 1:
        _check_peers(tensor, problem, pg, op, wire)
    elif problem is not None:
        raise problem
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
        ring = _make_ring(flat, pg, stats, divisor=world if op == "avg" else 1, wire=wire, cross=cross)
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

    1. reduce-scatter over ``intra_group`` (this node's L processes, L-1 steps): local rank i ends
       with the node's sum of chunk ``(i + 1) % L`` of L;
    2. a full ring over ``inter_group`` (local rank i of every node, 2 (N-1) steps) on that chunk
       alone, 1/L of the tensor, dividing by N x L for ``"avg"``;
    3. all-gather over ``intra_group`` (L-1 steps).

    Each process sends ``2 (L-1)/L x numel`` elements inside its node and ``2 (N-1)/N x numel/L``
    to other nodes (the flat ring: ``2 (NL-1)/(NL) x numel`` on the links that cross nodes). The
    result equals ``dist.all_reduce`` over the N x L processes up to summation order and is
    bit-identical on all of them (with a wire dtype too). With one node (N = 1) or one process per
    node (L = 1) it is the flat ring over the other group.

    Args:
        tensor: as :func:`ring_all_reduce`.
        intra_group: this process's node (:func:`new_hierarchical_groups`).
        inter_group: this process's local rank on every node, in node order.
        op: ``"sum"`` or ``"avg"``.
        wire_dtype: as :func:`ring_all_reduce`; partial sums are rounded once per hop of each
            stage (``(L-1) + (N-1)`` roundings at most, then the final value once).
        check_peers: as :func:`ring_all_reduce`, checked inside each node and then across nodes
            (a bad call on any process raises on every process).
        segment_bytes: as :func:`ring_all_reduce`.

    Returns:
        This process's bytes, with the node split: ``inter_node_bytes_sent`` (received) is what it
        sent to (received from) other nodes, exactly ``2 (N-1)/N x numel/L x itemsize`` up to the
        uneven chunking's few elements.

    Raises:
        TypeError, ValueError, RingPeerError: as :func:`ring_all_reduce`.
    """
    start = time.perf_counter()
    local, nodes = dist.get_world_size(intra_group), dist.get_world_size(inter_group)
    wire, problem = _validated(tensor, op, wire_dtype)
    if check_peers and local * nodes > 1:
        _check_peers_hierarchical(tensor, problem, intra_group, inter_group, op, wire)
    elif problem is not None:
        raise problem
    stats = CommStats(calls=1, inter_node_bytes_sent=0, inter_node_bytes_received=0)
    if local * nodes > 1 and tensor.numel() > 0:
        wire = None if wire == tensor.dtype else wire
        flat = tensor.view(-1)
        divisor = local * nodes if op == "avg" else 1
        if nodes == 1 or local == 1:
            across = nodes > 1
            pg = inter_group if across else intra_group
            _run(_make_ring(flat, pg, stats, divisor=divisor, wire=wire, cross=(across, across)), segment_bytes)
        else:
            inside = _make_ring(flat, intra_group, stats, divisor=1, wire=wire, stop=local - 1, round_owner=False)
            _run(inside, segment_bytes)
            a, b = inside.chunks[(inside.rank + 1) % local]  # the chunk this process now owns for its node
            if b > a:  # the same chunk index on every node: all empty (numel < L) or none
                _run(_make_ring(flat[a:b], inter_group, stats, divisor=divisor, wire=wire, cross=(True, True)),
                     segment_bytes)  # fmt: skip
            _run(_make_ring(flat, intra_group, stats, divisor=1, wire=wire, first=local - 1), segment_bytes)
    stats.seconds = time.perf_counter() - start
    return stats
