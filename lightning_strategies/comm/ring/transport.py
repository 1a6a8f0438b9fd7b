"""The ring's steps over point-to-point messages: segmented on gloo, one grouped exchange per step on NCCL.

Chunks are as even as the element count allows (no padded copy): the bytes summed over ranks are exactly
``2 (P-1) x numel x itemsize``. On gloo a segment is forwarded as soon as it has been added, so receiving,
adding and sending overlap; NCCL p2p needs grouped calls (NCCL's own all-reduce is the fast one).
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_strategies.comm.stats import CommStats

__all__ = ["RingPeerError", "release_workspace"]

# Every message costs kernel and wake-up work of its own, so segments are larger than gloo's
# 1 MiB; much larger ones pipeline too coarsely when ranks share cores. A 2 MiB wire segment
# carries the same 1M elements as a 4 MiB float32 one (and upcasts into a 4 MiB scratch).
_SEGMENT_BYTES = 4 << 20
_WIRE_SEGMENT_BYTES = 2 << 20
# Receives posted ahead: gloo writes a send straight into the socket only once the peer has posted
# the matching receive, and hands it to its event-loop thread otherwise.
_WINDOW = 4


class RingPeerError(RuntimeError):
    """A ring step failed because a neighbour stopped answering (died, hung, or left).

    Attributes:
        rank: this process's rank in the group.
        peer: the group rank of the neighbour whose send or receive failed.
        global_peer: the neighbour's global rank (the rank its error message names).
    """

    def __init__(self, message: str, *, rank: int, peer: int, global_peer: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.global_peer = peer if global_peer is None else global_peer


def _chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``numel``, sizes differing by at most one (no padding)."""
    base, extra = divmod(numel, parts)
    sizes = [base + 1 if i < extra else base for i in range(parts)]
    return list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))


def _segments(bounds: tuple[int, int], seg_elems: int) -> list[tuple[int, int]]:
    start, end = bounds
    return [(a, min(a + seg_elems, end)) for a in range(start, end, seg_elems)]


class _Workspace(threading.local):
    """Per-thread scratch buffers, grown to the largest call and kept until :func:`release_workspace`
    (fresh large CPU buffers cost first-touch page faults far above the copy into them)."""

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
    """Everything one call needs, computed once; ``first`` / ``stop`` select the steps (the hierarchical
    ring's stages: reduce-scatter ``[0, P-1)``, all-gather ``[P-1, 2 (P-1))``)."""

    flat: torch.Tensor
    pg: dist.ProcessGroup
    stats: CommStats
    divisor: int  # 1 for a sum; the number of summed tensors for an average (a hierarchical one: N x L)
    wire: torch.dtype | None
    first: int = 0
    stop: int = -1  # -1: 2 (P-1)
    # Round the owned chunk to the wire dtype at the end of the reduce-scatter, so that every rank ends
    # bit-identical; off when the chunk goes on into another ring rather than to the all-gather.
    round_owner: bool = True
    cross: tuple[bool, bool] = (False, False)  # the successor / predecessor on another node (CommStats' split)

    def __post_init__(self) -> None:
        self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        self.chunks = _chunk_bounds(self.flat.numel(), self.world)
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
        stats = self.stats
        stats.bytes_sent += sent
        stats.bytes_received += received
        if stats.inter_node_bytes_sent is not None and self.cross[0]:
            stats.inter_node_bytes_sent += sent
        if stats.inter_node_bytes_received is not None and self.cross[1]:
            stats.inter_node_bytes_received += received

    def send_chunk(self, t: int) -> int:
        """Chunk sent at step ``t``: reduce-scatter sends r, r-1, ...; all-gather r+1, r, ..."""
        if t < self.world - 1:
            return (self.rank - t) % self.world
        return (self.rank + 1 - (t - self.world + 1)) % self.world

    def recv_chunk(self, t: int) -> int:
        return self.send_chunk(t + 1)  # what we receive at step t is what we forward at step t+1

    def absorb(
        self,
        t: int,
        mine: torch.Tensor,
        got: torch.Tensor,
        scratch: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Fold the segment ``got`` received at step ``t`` into ``mine`` (the same range of the tensor).

        With a wire dtype, reduce-scatter writes the value to forward into ``out`` (default ``got``); ``scratch``
        holds the upcast segment (a cast then a same-dtype add is cheaper than one mixed-dtype add).
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
        # Last reduce-scatter step, the owned chunk: the sum is formed in the scratch (``mine`` read and
        # written once), and the owner's copy is rounded too, so every rank ends bit-identical (DDP
        # replicas would drift apart otherwise).
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


def _guarded(ring: _Ring, call: Callable[[], Any], peer: int, what: str, t: int) -> Any:
    """Start a send / receive, or wait for one, as a :class:`RingPeerError` on failure."""
    try:
        return call()
    except RuntimeError as exc:  # gloo's for closed connections (at once when posting on one) and timeouts
        raise ring.fail(exc, peer, what, t) from exc


# A function of its own: the fault tests replace it to stop a rank mid-ring, once a segment has arrived.
def _reduce_segment(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _ring_pipelined(ring: _Ring, seg_elems: int, window: int = _WINDOW) -> None:
    """gloo path: a stream of segments (tagged by unit), ``window`` receives in flight, each forwarded on arrival.

    A forwarded segment may wait a whole step in gloo's FIFO send queue, so what is forwarded lives in
    tensor-sized storage written once per range and phase (the tensor, or its wire-dtype shadow):
    all-gather segments land where they leave from, and no step waits for the previous one to drain.
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
            _guarded(ring, w.wait, ring.nxt, "sending to", t)

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
        return _guarded(ring, lambda: pg.recv([dst], ring.prev, u), ring.prev, "receiving from", t)

    def send(t: int, k: int, src: torch.Tensor) -> None:
        work = _guarded(ring, lambda: pg.send([src], ring.nxt, send_base[t] + k), ring.nxt, "sending to", t)
        pending.setdefault(t, []).append(work)
        ring.count(sent=src.numel() * itemsize)

    posted = [post_recv(u) for u in range(min(window, len(recv_units)))]
    for k, (a, b) in enumerate(segs[ring.send_chunk(ring.first)]):
        if wire is not None:  # exact at the all-gather's start: the chunk was rounded to the wire dtype
            forward[a:b].copy_(flat[a:b])
        send(ring.first, k, forward[a:b])
    for u, (t, k, a, b) in enumerate(recv_units):
        _guarded(ring, posted[u].wait, ring.prev, "receiving from", t)
        if u + window < len(recv_units):
            posted.append(post_recv(u + window))
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
            works = _guarded(ring, functools.partial(dist.batch_isend_irecv, ops), ring.prev, "exchanging with", t)
            for w in works:
                _guarded(ring, w.wait, ring.prev, "exchanging with", t)
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
