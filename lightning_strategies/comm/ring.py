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
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_strategies.comm.stats import CommStats

__all__ = [
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "RingBucketReducer",
    "RingPeerError",
    "release_workspace",
    "resolve_wire_dtype",
    "ring_all_reduce",
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


class RingPeerError(RuntimeError):
    """A ring step failed because a neighbour stopped answering (died, hung, or left).

    Attributes:
        rank: this process's rank in the group.
        peer: the group rank of the neighbour whose send or receive failed.
    """

    def __init__(self, message: str, *, rank: int, peer: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


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


def _check_peers(
    tensor: Any, problem: Exception | None, group: dist.ProcessGroup, op: str, wire: torch.dtype | None
) -> None:
    """One small all-gather so that a bad or mismatched call raises on *every* rank.

    Without it a rank with a different size would post receives its peers never match and
    wait for the process-group timeout; a rank with a bad input would raise alone and leave
    its peers waiting. The cost is one collective of a few integers per call.
    """
    ok = isinstance(tensor, torch.Tensor)
    mine = [  # numel, dtype, op and wire dtype must agree across ranks; then whether the input is ok
        tensor.numel() if ok else -1,
        _dtype_code(tensor.dtype) if ok else -1,
        _OPS.index(op) if op in _OPS else -1,
        _dtype_code(wire),
        int(problem is None),
    ]
    device = tensor.device if ok and tensor.device.type != "meta" else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size(group)
    rows = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    table = [row.cpu().tolist() for row in rows]
    rank = dist.get_rank(group)
    if problem is not None:
        raise problem
    bad = [r for r, row in enumerate(table) if row[4] == 0]
    if bad:
        raise ValueError(
            f"ring_all_reduce: rank(s) {bad} rejected their input (see their error); "
            f"rank {rank} stops too so that no rank waits for messages that will never come."
        )
    if any(row[:4] != table[0][:4] for row in table):
        desc = "; ".join(
            f"rank {r}: numel={row[0]} dtype={_dtype_name(row[1])} op={_OPS[row[2]]} wire_dtype={_dtype_name(row[3])}"
            for r, row in enumerate(table)
        )
        raise ValueError(
            f"ring_all_reduce: ranks disagree on the call ({desc}). Every rank must pass a tensor of "
            "the same numel and dtype with the same op and wire_dtype."
        )


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
    """Everything one call needs, computed once, so the step loop is only messages and adds."""

    flat: torch.Tensor
    pg: dist.ProcessGroup
    rank: int
    world: int
    avg: bool
    wire: torch.dtype | None
    chunks: list[tuple[int, int]]
    stats: CommStats

    @property
    def nxt(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def steps(self) -> int:
        return 2 * (self.world - 1)

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
            if t == world - 2 and self.avg:
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
        if self.avg:
            self._divide(up)
        out.copy_(up)
        mine.copy_(out)

    def _divide(self, seg: torch.Tensor) -> None:
        if seg.is_floating_point():
            seg.div_(self.world)
        else:
            seg.div_(self.world, rounding_mode="trunc")  # C / NCCL integer division

    def fail(self, exc: BaseException, peer: int, what: str, t: int) -> RingPeerError:
        phase = "reduce-scatter" if t < self.world - 1 else "all-gather"
        step = t if t < self.world - 1 else t - self.world + 1
        return RingPeerError(
            f"ring_all_reduce on rank {self.rank} of {self.world}: {what} peer rank {peer} failed at "
            f"{phase} step {step + 1}/{self.world - 1} ({exc}). Peer rank {peer} died, hung past the "
            "process-group timeout, or stopped on an error of its own: in a ring one lost rank fails "
            "its neighbours in turn, and the earliest of these errors names the rank that was lost.",
            rank=self.rank,
            peer=peer,
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
    steps = ring.steps
    recv_units = [(t, k, a, b) for t in range(steps) for k, (a, b) in enumerate(segs[ring.recv_chunk(t)])]
    send_base = [0] * (steps + 1)  # unit index (= tag) of the first segment sent at each step
    for t in range(steps):
        send_base[t + 1] = send_base[t] + len(segs[ring.send_chunk(t)])
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
        return t >= world - 1 and (wire is None or t + 1 < steps)

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
        ring.stats.bytes_received += dst.numel() * itemsize
        return _post(ring, lambda: pg.recv([dst], ring.prev, u), ring.prev, "receiving from", t)

    def send(t: int, k: int, src: torch.Tensor) -> None:
        work = _post(ring, lambda: pg.send([src], ring.nxt, send_base[t] + k), ring.nxt, "sending to", t)
        pending.setdefault(t, []).append(work)
        ring.stats.bytes_sent += src.numel() * itemsize

    posted = [post_recv(u) for u in range(min(window, len(recv_units)))]
    for k, (a, b) in enumerate(segs[ring.send_chunk(0)]):
        if wire is not None:
            forward[a:b].copy_(flat[a:b])
        send(0, k, forward[a:b])
    for u, (t, k, a, b) in enumerate(recv_units):
        _wait(ring, posted[u], ring.prev, "receiving from", t)
        if u + window < len(recv_units):
            posted.append(post_recv(u + window))
        # Reduce-scatter with a wire dtype writes the value to forward into the shadow;
        # otherwise it is left in the tensor, or (all-gather) arrived where it leaves from.
        out = forward[a:b] if wire is not None and t < world - 1 else None
        ring.absorb(t, flat[a:b], landing(u), scratch, out)
        if t + 1 < steps:
            send(t + 1, k, forward[a:b])
    for step in sorted(pending):
        drain(step, steps - 1)


def _ring_batched(ring: _Ring) -> None:
    """NCCL path (and a cross-check on gloo): one grouped send/recv of a whole chunk per step."""
    flat, wire, world = ring.flat, ring.wire, ring.world
    buf_dtype = wire if wire is not None else flat.dtype
    max_chunk = max(e - s for s, e in ring.chunks)
    out, inp = _WORKSPACE.get("forward", 2 * max_chunk, buf_dtype, flat.device).split(max_chunk)
    scratch = _WORKSPACE.get("scratch", max_chunk, flat.dtype, flat.device) if wire is not None else None
    nxt = dist.get_global_rank(ring.pg, ring.nxt)
    prev = dist.get_global_rank(ring.pg, ring.prev)
    (a, b) = ring.chunks[ring.send_chunk(0)]
    out[: b - a].copy_(flat[a:b])
    for t in range(ring.steps):
        (sa, sb), (ra, rb) = ring.chunks[ring.send_chunk(t)], ring.chunks[ring.recv_chunk(t)]
        ops: list[dist.P2POp] = []
        if sb > sa:
            ops.append(dist.P2POp(dist.isend, out[: sb - sa], nxt, ring.pg))
            ring.stats.bytes_sent += (sb - sa) * buf_dtype.itemsize
        if rb > ra:
            ops.append(dist.P2POp(dist.irecv, inp[: rb - ra], prev, ring.pg))
            ring.stats.bytes_received += (rb - ra) * buf_dtype.itemsize
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


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    op: str = "sum",
    wire_dtype: str | torch.dtype | None = None,
    check_peers: bool = True,
    segment_bytes: int | None = None,
) -> CommStats:
    """Reduce ``tensor`` in place across ``group`` with a ring (reduce-scatter, then all-gather).

    Blocks until this rank's result is complete. Equals ``dist.all_reduce`` up to summation
    order. Integer ``"avg"`` divides the sum with truncation toward zero (C / NCCL semantics).

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

    Returns:
        What this rank sent, received and how long the call took. ``bytes_sent`` is
        ``2 (P-1) / P x numel x wire itemsize`` up to two elements of uneven chunking.

    Raises:
        TypeError: ``tensor`` is not a tensor, or of an unsupported dtype.
        ValueError: non-contiguous tensor, bad ``op`` or ``wire_dtype``, or (with
            ``check_peers``) ranks disagreeing on the call.
        RingPeerError: a neighbour died or stopped answering within the group's timeout
            (``peer`` is its rank in ``group``).
    """
    start = time.perf_counter()
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(
            "ring_all_reduce needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first or pass group=..."
        )
    world = dist.get_world_size(pg)
    wire: torch.dtype | None = None
    problem: Exception | None
    try:
        wire = resolve_wire_dtype(wire_dtype)
        problem = _local_problem(tensor, op, wire)
    except ValueError as exc:  # told to the peers like any other bad input
        problem = exc
    if check_peers and world > 1:
        _check_peers(tensor, problem, pg, op, wire)
    elif problem is not None:
        raise problem
    stats = CommStats(calls=1)
    if world == 1 or tensor.numel() == 0:
        stats.seconds = time.perf_counter() - start
        return stats
    if wire == tensor.dtype:
        wire = None
    flat = tensor.view(-1)
    ring = _Ring(
        flat=flat,
        pg=pg,
        rank=dist.get_rank(pg),
        world=world,
        avg=op == "avg",
        wire=wire,
        chunks=_chunk_bounds(tensor.numel(), world),
        stats=stats,
    )
    if flat.device.type == "cpu":  # gloo: its tcp pairs take many small messages well
        if segment_bytes is None:
            segment_bytes = _SEGMENT_BYTES if wire is None else _WIRE_SEGMENT_BYTES
        _ring_pipelined(ring, max(1, segment_bytes // (wire or tensor.dtype).itemsize))
    else:
        _ring_batched(ring)
    stats.seconds = time.perf_counter() - start
    return stats


class RingBucketReducer:
    """Reduce tensors with :func:`ring_all_reduce` on one background thread, returning futures.

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

    Args:
        group: a process group used only by this reducer.
        op: ``"sum"`` or ``"avg"`` (DDP expects averaged gradients: ``"avg"``).
        wire_dtype: see :func:`ring_all_reduce`.
        check_peers: see :func:`ring_all_reduce`; off by default because DDP already checks.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        op: str = "avg",
        wire_dtype: str | torch.dtype | None = None,
        check_peers: bool = False,
    ) -> None:
        if op not in _OPS:
            raise ValueError(f"Invalid op {op!r}: expected one of {list(_OPS)}.")
        self.group = group
        self.op = op
        self.wire_dtype = resolve_wire_dtype(wire_dtype)
        self.check_peers = check_peers
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
        """Everything counted since the last call (thread-safe), and reset the counters."""
        with self._lock:
            return self._stats.reset()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread once queued work is done; return whether it stopped within ``timeout``.

        A thread still blocked in a ring call (a peer hung) is left behind: it is a daemon, so it
        cannot keep the process alive, and its group must not be destroyed under it.
        """
        self._stopper.detach()
        return _stop_reducer_thread(self._queue, self._thread, timeout)

    def _reduce(self, tensor: torch.Tensor, event: Any) -> CommStats:
        def run() -> CommStats:
            return ring_all_reduce(
                tensor, self.group, op=self.op, wire_dtype=self.wire_dtype, check_peers=self.check_peers
            )

        if event is None:
            return run()
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        with torch.cuda.device(tensor.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            return run()

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
