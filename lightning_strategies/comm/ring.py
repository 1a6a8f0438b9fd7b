"""Ring all-reduce over torch.distributed point-to-point messages, with byte accounting.

The tensor is cut into P chunks (P = group size). In the *reduce-scatter* phase every rank
sends one chunk to its successor and adds the chunk it receives from its predecessor, P-1
times, after which rank ``r`` holds the full sum of chunk ``(r + 1) % P``. In the
*all-gather* phase the reduced chunks travel once more around the ring (P-1 steps) and
overwrite the stale copies. Every rank therefore sends ``2 (P-1) / P`` of the tensor, less
than twice the tensor however many ranks there are: no link carries more, which is why the
ring is bandwidth-optimal.

Chunks are split as evenly as the element count allows (sizes differ by at most one
element) instead of being padded, so no padded copy of the tensor is ever made and the bytes
summed over ranks are exactly ``2 (P-1) x numel x itemsize``; a single rank is off the
formula by at most two elements.

On gloo the chunks travel in segments (4 MiB, or 2 MiB with a wire dtype; gloo's own ring
uses 1 MiB): a few receives are always posted ahead, and as soon as one segment has arrived
and been added it is forwarded to the successor, so receiving, adding and sending overlap.
With a wire dtype what is forwarded lives in a wire-dtype shadow of the tensor, so a
segment is converted once per hop and an all-gather segment is forwarded as it arrived.
On NCCL each step is one ``batch_isend_irecv`` of a whole chunk (NCCL p2p needs grouped calls
to avoid deadlock; the point of the NCCL path is correctness, NCCL's own all-reduce is the
fast one).

:class:`RingBucketReducer` runs the ring on a background thread and hands out futures, the
shape a ``DistributedDataParallel`` communication hook needs.

**Hierarchical** (:func:`hierarchical_all_reduce`, Horovod's hierarchical all-reduce): on N nodes of
L processes, a reduce-scatter ring inside each node (every process ends with the node's sum of
one L-th of the tensor), then L rings across the nodes, one per local rank, each on its L-th
(reduced across nodes, 2(N-1) steps), then an all-gather ring inside each node. Every process
sends ``2 (L-1) / L`` of the tensor to its own node and only ``2 (N-1) / N x 1/L`` of it to other
nodes, and the serial steps that cross nodes drop from 2(NL-1) to 2(N-1). Which processes share
a node is a :class:`NodeLayout`, from the launcher's node and local ranks (never host names);
:func:`new_hierarchical_groups` makes the intra- and inter-node process groups.

**Small chunks at large P**: every step of a ring call moves one P-th of the tensor, so a fixed
DDP bucket is cut into ever smaller messages as P grows, until each step costs its per-message
latency rather than its bytes (25 MiB at P = 256: 510 serial steps of 100 KiB).
:func:`ring_bucket_cap_mb` grows the bucket so that every step moves at least
:data:`MIN_CHUNK_BYTES`: fewer ring calls per backward pass, each of larger messages.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_strategies.comm.stats import CommStats

__all__ = [
    "MIN_CHUNK_BYTES",
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "NodeLayout",
    "RingBucketReducer",
    "RingPeerError",
    "hierarchical_all_reduce",
    "new_hierarchical_groups",
    "release_workspace",
    "resolve_wire_dtype",
    "ring_all_reduce",
    "ring_bucket_cap_mb",
]

#: Dtypes ``ring_all_reduce`` reduces: those gloo and NCCL both support for sum, minus bool
#: (whose "sum" is a logical or) and complex (reduce ``torch.view_as_real(t)`` instead).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)

#: Names accepted for ``wire_dtype`` (the strategy takes the short ones, from YAML).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

_OPS = ("sum", "avg")
# Every message costs kernel and wake-up work of its own, so segments are larger than gloo's
# 1 MiB; much larger ones pipeline too coarsely when ranks share cores. A 2 MiB wire segment
# carries the same 1M elements as a 4 MiB float32 one (and upcasts into a 4 MiB scratch).
_SEGMENT_BYTES = 4 << 20
_WIRE_SEGMENT_BYTES = 2 << 20
# Receives posted ahead: gloo writes a send straight into the socket only once the peer has posted
# the matching receive, and hands it to its event-loop thread otherwise.
_WINDOW = 4
# Codes exchanged by the peer check; -1 stands for "not in the list" (an unsupported dtype).
_DTYPE_CODES: tuple[torch.dtype, ...] = (*SUPPORTED_DTYPES, torch.bool, torch.complex64, torch.complex128)

#: Smallest chunk (bytes) a ring step should move; :func:`ring_bucket_cap_mb` grows DDP's bucket to
#: P x this. A step costs about ``latency + chunk / bandwidth``: on 100 Gb/s links (12.5 GB/s) with
#: 5-10 us per message, latency x bandwidth is 60-125 KB, so a 256 KiB chunk keeps every step at
#: least two-thirds bandwidth-bound. With DDP's 25 MiB buckets it changes nothing below P = 100.
MIN_CHUNK_BYTES = 256 << 10


class RingPeerError(RuntimeError):
    """A ring step failed because a neighbour stopped answering (died, hung, or left).

    Attributes:
        rank: this process's rank in the group.
        peer: the group rank of the neighbour whose send or receive failed.
        global_peer: the neighbour's global rank (the rank its error message names; equal to
            ``peer`` when the group is the world, as in the flat ring).
    """

    def __init__(self, message: str, *, rank: int, peer: int, global_peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.global_peer = peer if global_peer is None else global_peer


@dataclass(frozen=True)
class NodeLayout:
    """Which processes share a node: the global ranks on each node, in local-rank order.

    Built from every process's node rank and local rank as the launcher assigns them
    (:meth:`from_ranks`; Lightning's cluster environment reads torchrun's ``GROUP_RANK`` /
    ``LOCAL_RANK``, SLURM's ``SLURM_NODEID`` / ``SLURM_LOCALID``), not from host names, which
    containers, aliases and multi-homed hosts make unreliable. Global ranks need not be
    contiguous per node (SLURM's cyclic distribution).

    Attributes:
        nodes: ``nodes[n][i]`` is the global rank of local rank ``i`` on node ``n``.
    """

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks(cls, node_ranks: Sequence[int], local_ranks: Sequence[int]) -> NodeLayout:
        """The layout of processes whose node and local ranks are given by global rank.

        Raises:
            ValueError: the node ranks are not 0..N-1, or a node's local ranks are not 0..L-1 once each.
        """
        if len(node_ranks) != len(local_ranks) or not node_ranks:
            raise ValueError(
                f"NodeLayout: found {len(node_ranks)} node ranks and {len(local_ranks)} local ranks: expected one "
                "of each per process (indexed by global rank)."
            )
        count = max(node_ranks) + 1
        members: list[dict[int, int]] = [{} for _ in range(count)]
        for rank, (node, local) in enumerate(zip(node_ranks, local_ranks, strict=True)):
            if node < 0 or local < 0:
                raise ValueError(
                    f"NodeLayout: rank {rank} has node rank {node} and local rank {local}: expected both >= 0."
                )
            if local in members[node]:
                raise ValueError(
                    f"NodeLayout: ranks {members[node][local]} and {rank} both claim local rank {local} on node "
                    f"{node}: expected each local rank once per node. Fix: check the launcher's LOCAL_RANK / "
                    "SLURM_LOCALID."
                )
            members[node][local] = rank
        empty = [node for node, locals_ in enumerate(members) if not locals_]
        if empty:
            raise ValueError(
                f"NodeLayout: found node ranks {sorted(set(node_ranks))}, no process on node(s) {empty}: expected "
                f"node ranks 0..{count - 1} without gaps. Fix: check the launcher's NODE_RANK / GROUP_RANK / "
                "SLURM_NODEID."
            )
        for node, locals_ in enumerate(members):
            if sorted(locals_) != list(range(len(locals_))):
                raise ValueError(
                    f"NodeLayout: node {node} has local ranks {sorted(locals_)}: expected 0..{len(locals_) - 1}. "
                    "Fix: check the launcher's LOCAL_RANK / SLURM_LOCALID."
                )
        return cls(tuple(tuple(m[i] for i in range(len(m))) for m in members))

    @classmethod
    def contiguous(cls, num_nodes: int, local_size: int) -> NodeLayout:
        """``num_nodes`` nodes of ``local_size`` processes, global rank = node x local_size + local rank."""
        if num_nodes < 1 or local_size < 1:
            raise ValueError(f"NodeLayout: found {num_nodes} nodes of {local_size}: expected at least 1 of each.")
        return cls(tuple(tuple(range(n * local_size, (n + 1) * local_size)) for n in range(num_nodes)))

    @property
    def num_nodes(self) -> int:
        """The number of nodes N."""
        return len(self.nodes)

    @property
    def world(self) -> int:
        """The number of processes."""
        return sum(len(n) for n in self.nodes)

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of processes."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def local_size(self) -> int:
        """The processes per node L (the same on every node).

        Raises:
            ValueError: the nodes run different numbers of processes (a hierarchical ring needs L everywhere).
        """
        self.require_uniform()
        return len(self.nodes[0])

    def require_uniform(self) -> None:
        """Raise unless every node runs the same number of processes."""
        if not self.uniform:
            sizes = [len(n) for n in self.nodes]
            raise ValueError(
                f"NodeLayout: found {sizes} processes on nodes 0..{self.num_nodes - 1}: expected the same number on "
                "every node, which a hierarchical ring needs (local rank i of each node meets the others' local "
                "rank i). Fix: start as many processes on every node (torchrun --nproc-per-node, SLURM "
                "--ntasks-per-node), or use the flat ring (hierarchical=False)."
            )

    def node_of(self, rank: int) -> int:
        """The node that global rank ``rank`` runs on."""
        for node, ranks in enumerate(self.nodes):
            if rank in ranks:
                return node
        raise ValueError(f"NodeLayout: rank {rank} is on no node: expected 0..{self.world - 1}.")

    def intra_node_ranks(self) -> list[list[int]]:
        """The global ranks of each node (one intra-node ring each)."""
        return [list(ranks) for ranks in self.nodes]

    def inter_node_ranks(self) -> list[list[int]]:
        """For each local rank i, the global ranks of local rank i on every node (one inter-node ring each)."""
        return [[ranks[i] for ranks in self.nodes] for i in range(self.local_size)]


def new_hierarchical_groups(
    layout: NodeLayout, *, backend: str | None = None, timeout: timedelta | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's (intra-node, inter-node) process groups for :func:`hierarchical_all_reduce`.

    Every process of the world must call it, with the same layout (``new_group`` is collective):
    it creates every node's group, then every local rank's group across the nodes, in that order.

    Raises:
        ValueError: the layout does not cover the world, or its nodes differ in size.
    """
    layout.require_uniform()
    if layout.world != dist.get_world_size():
        raise ValueError(
            f"new_hierarchical_groups: found a layout of {layout.world} processes in a world of "
            f"{dist.get_world_size()}: expected the layout of the whole world."
        )
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for ranks in layout.intra_node_ranks() + layout.inter_node_ranks():
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            assert isinstance(group, dist.ProcessGroup)
            mine.append(group)
    intra, inter = mine
    return intra, inter


def ring_bucket_cap_mb(bucket_cap_mb: float, world: int, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> float:
    """The DDP bucket size (MiB) that gives each of a ``world``-process ring's chunks ``min_chunk_bytes``.

    A ring call cuts its bucket into ``world`` chunks and moves one per step, 2 (world - 1) steps in
    series; the flat and the hierarchical ring alike end with chunks of ``bucket / world``. The
    rule: ``max(bucket_cap_mb, world x min_chunk_bytes / 2^20)``, so below
    ``bucket_cap_mb x 2^20 / min_chunk_bytes`` processes nothing changes, and above it the bucket
    grows linearly with P: fewer ring calls per backward pass (each with P-times-larger messages)
    at the price of a later start of the first call (less overlap with backward).
    ``min_chunk_bytes=0`` keeps ``bucket_cap_mb``.
    """
    if world < 1 or min_chunk_bytes < 0:
        raise ValueError(
            f"ring_bucket_cap_mb: found world={world}, min_chunk_bytes={min_chunk_bytes}: expected world >= 1 "
            "and min_chunk_bytes >= 0."
        )
    return max(float(bucket_cap_mb), world * min_chunk_bytes / float(1 << 20))


def resolve_wire_dtype(wire_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Turn ``None`` / ``"bf16"`` / ``"fp16"`` / ``torch.bfloat16`` / ``torch.float16`` into a dtype.

    Raises:
        ValueError: for any other value, listing the accepted ones.
    """
    if wire_dtype is None:
        return None
    if isinstance(wire_dtype, torch.dtype):
        if wire_dtype in WIRE_DTYPES.values():
            return wire_dtype
    elif isinstance(wire_dtype, str) and wire_dtype.lower() in WIRE_DTYPES:
        return WIRE_DTYPES[wire_dtype.lower()]
    raise ValueError(
        f"Invalid wire_dtype {wire_dtype!r}: expected None (send in the tensor's own dtype) or one of "
        f"{sorted(WIRE_DTYPES)} / torch.bfloat16 / torch.float16."
    )


def _local_problem(tensor: Any, op: str, wire: torch.dtype | None) -> Exception | None:
    """Why this rank cannot take part (the exception to raise), or None.

    Returned rather than raised so that :func:`_check_peers` can first tell the other ranks.
    """
    message = _problem_message(tensor, op, wire)
    if message is None:
        return None
    bad_type = not isinstance(tensor, torch.Tensor) or tensor.dtype not in SUPPORTED_DTYPES
    return (TypeError if bad_type else ValueError)(f"ring_all_reduce: {message}.")


def _problem_message(tensor: Any, op: str, wire: torch.dtype | None) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"expected a torch.Tensor, found {type(tensor).__name__}"
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        hint = " (reduce torch.view_as_real(tensor) instead)" if tensor.is_complex() else ""
        return f"unsupported dtype {tensor.dtype}{hint}; supported: {names}"
    if not tensor.is_contiguous():
        return (
            f"the tensor is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
            "the ring reduces the storage in place, so pass tensor.contiguous() and copy the result back"
        )
    if op not in _OPS:
        return f"invalid op {op!r}; expected one of {list(_OPS)}"
    if wire is not None and wire != tensor.dtype:
        if not tensor.is_floating_point():
            return f"wire_dtype={wire} needs a floating tensor, found {tensor.dtype}; pass wire_dtype=None"
        if wire.itemsize >= tensor.dtype.itemsize:
            return (
                f"wire_dtype={wire} is not narrower than the tensor's {tensor.dtype}; "
                "pass wire_dtype=None to send the tensor's own dtype"
            )
    return None


def _dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return -2
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1


def _dtype_name(code: int) -> str:
    return {-2: "None", -1: "unsupported"}.get(code) or str(_DTYPE_CODES[code]).removeprefix("torch.")


def _call_row(tensor: Any, problem: Exception | None, op: str, wire: torch.dtype | None) -> list[int]:
    """What the peer check exchanges: numel, dtype, op and wire dtype (must agree), then input ok."""
    ok = isinstance(tensor, torch.Tensor)
    return [
        tensor.numel() if ok else -1,
        _dtype_code(tensor.dtype) if ok else -1,
        _OPS.index(op) if op in _OPS else -1,
        _dtype_code(wire),
        int(problem is None),
    ]


def _gather_rows(tensor: Any, row: list[int], group: dist.ProcessGroup) -> list[list[int]]:
    ok = isinstance(tensor, torch.Tensor)
    device = tensor.device if ok and tensor.device.type != "meta" else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size(group)
    rows = [torch.empty(len(row), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(row, dtype=torch.int64, device=device), group=group)
    return [r.cpu().tolist() for r in rows]


def _verdict(table: list[list[int]], group: dist.ProcessGroup, who: str = "") -> ValueError | None:
    """The error every rank raises when some rank rejected its input or the ranks disagree, else None."""
    rank = dist.get_global_rank(group, dist.get_rank(group))
    ranks = [dist.get_global_rank(group, r) for r in range(len(table))]
    bad = [ranks[r] for r, row in enumerate(table) if row[4] == 0]
    if bad:
        return ValueError(
            f"ring_all_reduce: rank(s) {bad} rejected their input{who} (see their error); "
            f"rank {rank} stops too so that no rank waits for messages that will never come."
        )
    if any(row[:4] != table[0][:4] for row in table):
        desc = "; ".join(
            f"rank {ranks[r]}: numel={row[0]} dtype={_dtype_name(row[1])} op={_OPS[row[2]]} "
            f"wire_dtype={_dtype_name(row[3])}"
            for r, row in enumerate(table)
        )
        return ValueError(
            f"ring_all_reduce: ranks disagree on the call ({desc}). Every rank must pass a tensor of "
            "the same numel and dtype with the same op and wire_dtype."
        )
    return None


def _check_peers(
    tensor: Any, problem: Exception | None, group: dist.ProcessGroup, op: str, wire: torch.dtype | None
) -> None:
    """One small all-gather so that a bad or mismatched call raises on *every* rank.

    Without it a rank with a different size would post receives its peers never match and
    wait for the process-group timeout; a rank with a bad input would raise alone and leave
    its peers waiting. The cost is one collective of a few integers per call.
    """
    table = _gather_rows(tensor, _call_row(tensor, problem, op, wire), group)
    if problem is not None:
        raise problem
    verdict = _verdict(table, group)
    if verdict is not None:
        raise verdict


def _check_peers_hierarchical(
    tensor: Any,
    problem: Exception | None,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    op: str,
    wire: torch.dtype | None,
) -> None:
    """:func:`_check_peers` in two stages, inside the node then across: no group spans the world.

    The node's verdict travels in the second stage as this rank's "input ok", so a problem on
    one node reaches every local rank of every other node, which tells its node-mates in turn
    by raising too: every rank raises, none waits.
    """
    row = _call_row(tensor, problem, op, wire)
    inside = _gather_rows(tensor, row, intra)
    first = problem if problem is not None else _verdict(inside, intra)
    across = _gather_rows(tensor, [*row[:4], int(first is None)], inter)
    if first is not None:
        raise first
    verdict = _verdict(across, inter, " (or a process on their node did)")
    if verdict is not None:
        raise verdict


def _chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``numel``, sizes differing by at most one (no padding)."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _segments(bounds: tuple[int, int], seg_elems: int) -> list[tuple[int, int]]:
    start, end = bounds
    return [(a, min(a + seg_elems, end)) for a in range(start, end, seg_elems)]


class _Workspace(threading.local):
    """Scratch buffers reused across calls, one set per thread.

    Freshly allocated large CPU buffers are fresh pages from the kernel, whose first-touch page
    faults cost far more than the copy into them. The buffers grow to the largest call seen (on
    gloo a few segments, plus with a wire dtype a shadow of ``numel`` wire elements; on NCCL two
    chunks) and are kept until :func:`release_workspace`.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_WORKSPACE = _Workspace()


def release_workspace() -> None:
    """Free the scratch buffers :func:`ring_all_reduce` keeps for the calling thread."""
    _WORKSPACE.buffers.clear()


@dataclass
class _Ring:
    """Everything one call needs, computed once, so the step loop is only messages and adds.

    ``first`` / ``stop`` select the steps run: all ``2 (P-1)`` (the default), the reduce-scatter
    ``[0, P-1)`` or the all-gather ``[P-1, 2 (P-1))``, for the hierarchical ring's stages.
    """

    flat: torch.Tensor
    pg: dist.ProcessGroup
    rank: int
    world: int
    divisor: int  # 1 for a sum; the number of summed tensors for an average (a hierarchical one: N x L)
    wire: torch.dtype | None
    chunks: list[tuple[int, int]]
    stats: CommStats
    first: int = 0
    stop: int = -1  # -1: 2 (P-1)
    # Round the owned chunk to the wire dtype at the end of the reduce-scatter, so that every rank ends
    # bit-identical; off when the chunk goes on into another ring rather than to the all-gather.
    round_owner: bool = True
    cross_next: bool = False  # the successor / predecessor runs on another node (CommStats' node split)
    cross_prev: bool = False

    def __post_init__(self) -> None:
        if self.stop < 0:
            self.stop = self.steps

    @property
    def nxt(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def steps(self) -> int:
        return 2 * (self.world - 1)

    def count(self, *, sent: int = 0, received: int = 0) -> None:
        """Account payload bytes, split by node when the stats are."""
        stats = self.stats
        stats.bytes_sent += sent
        stats.bytes_received += received
        if stats.inter_node_bytes_sent is not None and self.cross_next:
            stats.inter_node_bytes_sent += sent
        if stats.inter_node_bytes_received is not None and self.cross_prev:
            stats.inter_node_bytes_received += received

    def send_chunk(self, t: int) -> int:
        """Chunk sent at step ``t``: reduce-scatter sends r, r-1, ...; all-gather r+1, r, ..."""
        if t < self.world - 1:
            return (self.rank - t) % self.world
        return (self.rank + 1 - (t - self.world + 1)) % self.world

    def recv_chunk(self, t: int) -> int:
        # What we receive at step t is what we forward at step t+1.
        if t < self.world - 1:
            return (self.rank - t - 1) % self.world
        return (self.rank - (t - self.world + 1)) % self.world

    def absorb(
        self,
        t: int,
        mine: torch.Tensor,
        got: torch.Tensor,
        scratch: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Fold the segment ``got`` received at step ``t`` into ``mine`` (the same range of the tensor).

        Without a wire dtype the segment to forward at step ``t + 1`` is then ``mine``. With one,
        reduce-scatter writes the wire-dtype value to forward into ``out`` (default ``got``), and
        all-gather only upcasts ``got`` into ``mine``: ``got`` itself is forwarded, never cast
        twice. ``scratch`` (tensor dtype, at least ``got.numel()``) holds the upcast segment:
        a cast followed by a same-dtype add is cheaper than one mixed-dtype
        ``torch.add(mine, got, out=scratch)``.
        """
        world, wire = self.world, self.wire
        if t >= world - 1:  # all-gather: the segment is final
            if wire is not None:
                mine.copy_(got)
            return
        if wire is None:
            _reduce_segment(mine, got)
            if t == world - 2 and self.divisor > 1:
                self._divide(mine)
            return
        assert scratch is not None
        out = got if out is None else out
        up = scratch[: got.numel()]
        up.copy_(got)
        if t < world - 2:
            # The partial sum is added in the tensor's dtype and rounded once, straight into the
            # wire buffer; ``mine`` is not written because the all-gather overwrites it anyway.
            _reduce_segment(up, mine)
            out.copy_(up)
            return
        # Last reduce-scatter step: this rank owns the chunk. The sum is formed in the cached
        # scratch (``mine`` is read once and written once), and the owner's copy is rounded too,
        # so every rank ends bit-identical (DDP replicas would drift apart otherwise).
        _reduce_segment(up, mine)
        if self.divisor > 1:
            self._divide(up)
        if not self.round_owner:  # the chunk goes on into another ring, which rounds it there
            mine.copy_(up)
            return
        out.copy_(up)
        mine.copy_(out)

    def _divide(self, seg: torch.Tensor) -> None:
        if seg.is_floating_point():
            seg.div_(self.divisor)
        else:
            seg.div_(self.divisor, rounding_mode="trunc")  # C / NCCL integer division

    def fail(self, exc: BaseException, peer: int, what: str, t: int) -> RingPeerError:
        phase = "reduce-scatter" if t < self.world - 1 else "all-gather"
        step = t if t < self.world - 1 else t - self.world + 1
        me, them = dist.get_global_rank(self.pg, self.rank), dist.get_global_rank(self.pg, peer)
        where = f"rank {me}" if me == self.rank else f"rank {me} (rank {self.rank} of its ring's group)"
        return RingPeerError(
            f"ring_all_reduce on {where}, a ring of {self.world}: {what} peer rank {them} failed at "
            f"{phase} step {step + 1}/{self.world - 1} ({exc}). Peer rank {them} died, hung past the "
            "process-group timeout, or stopped on an error of its own: in a ring one lost rank fails "
            "its neighbours in turn, and the earliest of these errors names the rank that was lost.",
            rank=self.rank,
            peer=peer,
            global_peer=them,
        )


def _wait(ring: _Ring, work: Any, peer: int, what: str, t: int) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo raises RuntimeError for closed connections and timeouts
        raise ring.fail(exc, peer, what, t) from exc


def _post(ring: _Ring, start: Callable[[], Any], peer: int, what: str, t: int) -> Any:
    """Start a send / receive; gloo raises at once if the pair's connection is already gone."""
    try:
        return start()
    except RuntimeError as exc:
        raise ring.fail(exc, peer, what, t) from exc


def _reduce_segment(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Accumulate a received segment in the tensor's own dtype (upcasting a wire segment)."""
    dst.add_(src)


def _ring_pipelined(ring: _Ring, seg_elems: int, window: int = _WINDOW) -> None:
    """gloo path: a stream of segments, ``window`` receives in flight, each forwarded on arrival.

    The (step, segment) pairs form one sequence of *units* per direction, matched by tag.
    ``window`` receives are posted ahead: gloo's tcp pair writes a send straight into the
    socket from the calling thread once the peer has announced the matching receive, and
    queues it for its event-loop thread otherwise. Reduce-scatter segments land in a few
    segment-sized slots that are still in cache for the add.

    A forwarded segment can wait a whole step in gloo's send queue (the link to the successor
    is FIFO and still carries the current step), so what is forwarded lives in tensor-sized
    storage in which every range is written once per phase: the tensor itself, or with a wire
    dtype a wire-dtype *shadow* of it. All-gather segments that are forwarded land there
    directly and leave from there (no copy), and the only wait on a send, before an
    all-gather segment lands on a range, is for that range's reduce-scatter send a whole phase
    earlier: no step waits for the previous one to drain.
    """
    flat, pg, wire, world = ring.flat, ring.pg, ring.wire, ring.world
    segs = [_segments(c, seg_elems) for c in ring.chunks]
    steps = range(ring.first, ring.stop)
    recv_units = [(t, k, a, b) for t in steps for k, (a, b) in enumerate(segs[ring.recv_chunk(t)])]
    send_base: dict[int, int] = {}  # unit index (= tag) of the first segment sent at each step
    tag = 0
    for t in steps:
        send_base[t] = tag
        tag += len(segs[ring.send_chunk(t)])
    buf_dtype = wire if wire is not None else flat.dtype
    itemsize = buf_dtype.itemsize
    dev = flat.device
    slot_size = min(seg_elems, max(e - s for s, e in ring.chunks))
    slots = list(_WORKSPACE.get("slots", slot_size * (window + 1), buf_dtype, dev).split(slot_size))
    scratch: torch.Tensor | None = None
    forward = flat  # where the value forwarded for each range lives
    if wire is not None:
        scratch = _WORKSPACE.get("scratch", slot_size, flat.dtype, dev)
        forward = _WORKSPACE.get("shadow", flat.numel(), wire, dev)
    pending: dict[int, list[Any]] = {}  # send step -> sends not yet known to be complete

    def drain(step: int, t: int) -> None:
        for w in pending.pop(step, []):
            _wait(ring, w, ring.nxt, "sending to", t)

    def lands_in_place(t: int) -> bool:
        # All-gather segments that are forwarded land where they leave from. With a wire dtype
        # the last step's are not forwarded: they land in a slot (cache) and are only upcast.
        return t >= world - 1 and (wire is None or t + 1 < ring.stop)

    def landing(u: int) -> torch.Tensor:
        t, _, a, b = recv_units[u]
        return forward[a:b] if lands_in_place(t) else slots[u % len(slots)][: b - a]

    def post_recv(u: int) -> Any:
        t = recv_units[u][0]
        if lands_in_place(t):
            # This range was sent once before, at reduce-scatter step t-(P-1); those sends
            # were issued a whole phase ago, so the wait is normally free.
            drain(t - (world - 1), t)
        dst = landing(u)
        ring.count(received=dst.numel() * itemsize)
        return _post(ring, lambda: pg.recv([dst], ring.prev, u), ring.prev, "receiving from", t)

    def send(t: int, k: int, src: torch.Tensor) -> None:
        work = _post(ring, lambda: pg.send([src], ring.nxt, send_base[t] + k), ring.nxt, "sending to", t)
        pending.setdefault(t, []).append(work)
        ring.count(sent=src.numel() * itemsize)

    posted = [post_recv(u) for u in range(min(window, len(recv_units)))]
    for k, (a, b) in enumerate(segs[ring.send_chunk(ring.first)]):
        if wire is not None:  # exact at the all-gather's start: the chunk was rounded to the wire dtype
            forward[a:b].copy_(flat[a:b])
        send(ring.first, k, forward[a:b])
    for u, (t, k, a, b) in enumerate(recv_units):
        _wait(ring, posted[u], ring.prev, "receiving from", t)
        if u + window < len(recv_units):
            posted.append(post_recv(u + window))
        # Reduce-scatter with a wire dtype writes the value to forward into the shadow;
        # otherwise it is left in the tensor, or (all-gather) arrived where it leaves from.
        out = forward[a:b] if wire is not None and t < world - 1 else None
        ring.absorb(t, flat[a:b], landing(u), scratch, out)
        if t + 1 < ring.stop:
            send(t + 1, k, forward[a:b])
    for step in sorted(pending):
        drain(step, ring.stop - 1)


def _ring_batched(ring: _Ring) -> None:
    """NCCL path (and a cross-check on gloo): one grouped send/recv of a whole chunk per step."""
    flat, wire, world = ring.flat, ring.wire, ring.world
    buf_dtype = wire if wire is not None else flat.dtype
    max_chunk = max(e - s for s, e in ring.chunks)
    out, inp = _WORKSPACE.get("forward", 2 * max_chunk, buf_dtype, flat.device).split(max_chunk)
    scratch = _WORKSPACE.get("scratch", max_chunk, flat.dtype, flat.device) if wire is not None else None
    nxt = dist.get_global_rank(ring.pg, ring.nxt)
    prev = dist.get_global_rank(ring.pg, ring.prev)
    (a, b) = ring.chunks[ring.send_chunk(ring.first)]
    out[: b - a].copy_(flat[a:b])
    for t in range(ring.first, ring.stop):
        (sa, sb), (ra, rb) = ring.chunks[ring.send_chunk(t)], ring.chunks[ring.recv_chunk(t)]
        ops: list[dist.P2POp] = []
        if sb > sa:
            ops.append(dist.P2POp(dist.isend, out[: sb - sa], nxt, ring.pg))
            ring.count(sent=(sb - sa) * buf_dtype.itemsize)
        if rb > ra:
            ops.append(dist.P2POp(dist.irecv, inp[: rb - ra], prev, ring.pg))
            ring.count(received=(rb - ra) * buf_dtype.itemsize)
        if ops:  # both chunks empty (numel < P) on both sides: nothing to exchange this step
            works = _post(ring, functools.partial(dist.batch_isend_irecv, ops), ring.prev, "exchanging with", t)
            for w in works:
                _wait(ring, w, ring.prev, "exchanging with", t)
        got, mine = inp[: rb - ra], flat[ra:rb]
        ring.absorb(t, mine, got, scratch)
        if wire is None:  # absorb left the value to forward in ``mine``; this path sends buffers
            if t < world - 1:
                got.copy_(mine)
            else:
                mine.copy_(got)
        out, inp = inp, out  # what arrived is what leaves next step


def _run(ring: _Ring, segment_bytes: int | None) -> None:
    if ring.flat.device.type == "cpu":  # gloo: its tcp pairs take many small messages well
        if segment_bytes is None:
            segment_bytes = _SEGMENT_BYTES if ring.wire is None else _WIRE_SEGMENT_BYTES
        _ring_pipelined(ring, max(1, segment_bytes // (ring.wire or ring.flat.dtype).itemsize))
    else:
        _ring_batched(ring)


def _make_ring(
    flat: torch.Tensor,
    pg: dist.ProcessGroup,
    stats: CommStats,
    *,
    divisor: int,
    wire: torch.dtype | None,
    cross: tuple[bool, bool] = (False, False),
    **phase: Any,
) -> _Ring:
    world = dist.get_world_size(pg)
    return _Ring(
        flat=flat,
        pg=pg,
        rank=dist.get_rank(pg),
        world=world,
        divisor=divisor,
        wire=wire,
        chunks=_chunk_bounds(flat.numel(), world),
        stats=stats,
        cross_next=cross[0],
        cross_prev=cross[1],
        **phase,
    )


def _validated(
    tensor: Any, op: str, wire_dtype: str | torch.dtype | None
) -> tuple[torch.dtype | None, Exception | None]:
    """The wire dtype and this rank's problem with the call (raised only after telling the peers)."""
    try:
        wire = resolve_wire_dtype(wire_dtype)
    except ValueError as exc:  # told to the peers like any other bad input
        return None, exc
    return wire, _local_problem(tensor, op, wire)


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


class RingBucketReducer:
    """Reduce tensors with :func:`ring_all_reduce` (or :func:`hierarchical_all_reduce`) on one
    background thread, returning futures.

    A ``DistributedDataParallel`` communication hook must return a future without blocking
    the backward pass, but gloo's point-to-point ``Work`` has no ``get_future()``. So the hook
    only enqueues the bucket; this thread reduces buckets one at a time *in submission order*
    (DDP submits them in bucket-index order on every rank, so all ranks meet in the same ring
    call) and completes each future. The thread uses its own process group so its messages
    never interleave with collectives the main thread runs on the default group.

    After a failure every later future fails at once with the same error, instead of each
    waiting out the process-group timeout on a ring that is already broken.

    The thread holds only a weak reference to the reducer: a reducer dropped without
    :meth:`close` (its strategy never torn down) stops its thread once collected, and one still
    alive at interpreter exit is closed then, before the interpreter tears down the modules a
    thread inside a gloo call would still use.

    On CUDA the reducer runs on a stream of its own, which waits for an event recorded on the
    submitting stream; the futures are CUDA-aware (``devices=``), so whoever waits on one has its
    stream wait for the reduction, and nothing blocks the host. Each call is timed with a pair
    of CUDA events, read (without waiting) by :meth:`pop_device_seconds`.

    Args:
        group: a process group used only by this reducer; with ``inter_group``, this process's
            node (the intra-node group of :func:`new_hierarchical_groups`).
        op: ``"sum"`` or ``"avg"`` (DDP expects averaged gradients: ``"avg"``).
        wire_dtype: see :func:`ring_all_reduce`.
        check_peers: see :func:`ring_all_reduce`; off by default because DDP already checks.
        inter_group: this process's inter-node group: reduce hierarchically
            (:func:`hierarchical_all_reduce`) instead of one flat ring over ``group``.
        layout: for the flat ring, the world's :class:`NodeLayout`, to split the byte counts
            by node (see :func:`ring_all_reduce`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        op: str = "avg",
        wire_dtype: str | torch.dtype | None = None,
        check_peers: bool = False,
        inter_group: dist.ProcessGroup | None = None,
        layout: NodeLayout | None = None,
    ) -> None:
        if op not in _OPS:
            raise ValueError(f"Invalid op {op!r}: expected one of {list(_OPS)}.")
        if inter_group is not None and layout is not None:
            raise ValueError(
                "RingBucketReducer: found both inter_group and layout: expected one (the hierarchical ring knows "
                "its node split from its groups; layout is for the flat ring's byte accounting)."
            )
        self.group = group
        self.inter_group = inter_group
        self.layout = layout
        self.op = op
        self.wire_dtype = resolve_wire_dtype(wire_dtype)
        self.check_peers = check_peers
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA calls not read yet
        self._queue: queue.SimpleQueue[tuple[torch.Tensor, torch.futures.Future[Any], Any] | None]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stats = CommStats()
        self._error: BaseException | None = None
        self._stream: Any = None
        self._thread = threading.Thread(
            target=_serve_reducer, args=(weakref.ref(self), self._queue), name="ring-all-reduce", daemon=True
        )
        self._thread.start()
        self._stopper = weakref.finalize(self, _stop_reducer_thread, self._queue, self._thread, _EXIT_JOIN_SECONDS)

    def submit(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Queue ``tensor`` for an in-place reduction; the future's value is ``tensor``."""
        if not self._thread.is_alive():
            raise RuntimeError("RingBucketReducer is closed; create a new one to reduce more tensors.")
        event = None
        if tensor.is_cuda:
            # The bucket is written on the caller's stream; the reducer's stream waits for it,
            # and the CUDA-aware future makes the consumer's stream wait for the reduction.
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[tensor.device])
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        else:
            fut = torch.futures.Future()
        self._queue.put((tensor, fut, event))
        return fut

    def pop_stats(self) -> CommStats:
        """Everything counted since the last call (thread-safe), and reset the counters.

        For CUDA tensors ``seconds`` stays 0: the host only enqueues the ring there, and its
        device time is read by :meth:`pop_device_seconds`.
        """
        with self._lock:
            return self._stats.reset()

    def pop_device_seconds(self) -> tuple[float, int]:
        """Device seconds and number of the CUDA calls completed since the last call, oldest first.

        Only events the device has passed are read (``Event.query``, which does not wait), so
        calls still running are counted by a later call; read it at logging steps, not every
        step. ``(0.0, 0)`` on CPU.
        """
        seconds, done = 0.0, 0
        with self._lock:
            for start, end in self._timings:
                if not end.query():  # the reducer's stream runs its calls in order: the rest are later
                    break
                seconds += start.elapsed_time(end) / 1000.0
                done += 1
            del self._timings[:done]
        return seconds, done

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once queued work is done; return whether it stopped within ``timeout``.

        A thread still blocked in a ring call (a peer hung) is left behind: it is a daemon, so it
        cannot keep the process alive, and its group must not be destroyed under it.
        """
        self._stopper.detach()
        return _stop_reducer_thread(self._queue, self._thread, timeout)

    def _reduce(self, tensor: torch.Tensor, event: Any) -> CommStats:
        def run() -> CommStats:
            if self.inter_group is not None:
                return hierarchical_all_reduce(
                    tensor,
                    self.group,
                    self.inter_group,
                    op=self.op,
                    wire_dtype=self.wire_dtype,
                    check_peers=self.check_peers,
                )
            return ring_all_reduce(
                tensor,
                self.group,
                op=self.op,
                wire_dtype=self.wire_dtype,
                check_peers=self.check_peers,
                layout=self.layout,
            )

        if event is None:
            return run()
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        with torch.cuda.device(tensor.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            # Recorded after the wait, so the pair times the ring itself, not the backward before it.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            stats = run()
            end.record(self._stream)
        stats.seconds = 0.0  # host time to enqueue, not the ring's: the events measure that
        with self._lock:
            self._timings.append((start, end))
        return stats

    def _complete(self, fut: torch.futures.Future[Any], tensor: torch.Tensor, event: Any) -> None:
        if event is None:
            fut.set_result(tensor)
            return
        with torch.cuda.device(tensor.device), torch.cuda.stream(self._stream):
            fut.set_result(tensor)  # records an event on the reducer stream for the consumer

    def _serve(self, tensor: torch.Tensor, fut: torch.futures.Future[Any], event: Any) -> None:
        """Reduce one queued tensor and complete its future (on the reducer thread)."""
        if self._error is not None:
            fut.set_exception(self._error)
            return
        try:
            stats = self._reduce(tensor, event)
        except BaseException as exc:
            self._error = exc
            fut.set_exception(exc)
            return
        with self._lock:
            self._stats += stats
        self._complete(fut, tensor, event)


#: How long interpreter exit (or garbage collection) waits for a reducer's queued work.
_EXIT_JOIN_SECONDS = 10.0


def _serve_reducer(
    reducer_ref: weakref.ReferenceType[RingBucketReducer],
    work: queue.SimpleQueue[tuple[torch.Tensor, torch.futures.Future[Any], Any] | None],
) -> None:
    """The reducer thread: a weak reference only, so that a dropped reducer can be collected."""
    while (item := work.get()) is not None:
        reducer = reducer_ref()
        if reducer is None:  # dropped with work queued: fail it rather than leave a waiter hanging
            item[1].set_exception(RuntimeError("RingBucketReducer was dropped before reducing this tensor."))
            continue
        reducer._serve(*item)
        del reducer  # no strong reference while waiting for the next item


def _stop_reducer_thread(
    work: queue.SimpleQueue[tuple[torch.Tensor, torch.futures.Future[Any], Any] | None],
    thread: threading.Thread,
    timeout: float,
) -> bool:
    """Let ``thread`` finish the queued work and stop; whether it stopped within ``timeout``."""
    if thread.is_alive():
        work.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)
    return not thread.is_alive()
