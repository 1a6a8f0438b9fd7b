"""The hierarchical push overlapped with backward, its all-gather with the next forward (no Lightning import).

:mod:`.hierarchy`'s three phases, per bucket of :mod:`.buckets` instead of once after the whole backward:

1. when backward has filled bucket ``b`` (and every bucket before it: the node's collectives must be issued
   in one order on every member, as DDP's reducer launches its buckets in index order), its gradients,
   divided by ``P``, go into the bucket's buffer chunk by chunk and an asynchronous reduce-scatter inside
   the node leaves local rank ``j`` the node's sum of its chunk's part of the bucket;
2. once that reduce-scatter is done, local rank ``j`` pushes the bucket's part of each of its ``N`` shards
   (a part of the node's step, :meth:`~lightning_strategies.comm.ps.ParameterShard.push`), without waiting;
   a shard answers a node's last part with its new values;
3. at the next forward's first wait, the worker waits for its own shards' values, writes them into each
   bucket's chunk and starts one asynchronous all-gather per bucket inside the node, the last bucket (the
   first layers) first; each module's forward pre-hook then waits only for the all-gathers of its own
   tensors' buckets.

A bucket's reduce-scatter is waited for, and pushed, at the latest when the next bucket is launched (one
bucket in flight in the node), else as soon as a later gradient hook finds it done: the pushes leave during
backward, from the training thread (no RPC call, and so no shard's step, on a backend's thread). The
arithmetic is :mod:`.hierarchy`'s, element by element: the same weights bit for bit where the node's sum
does not depend on the buffer's length (two processes per node).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_strategies.comm.ps.buckets import OverlappedPush
from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient
from lightning_strategies.comm.ps.hosting import _rpc_push, local_shard
from lightning_strategies.comm.ps.plan import Slice
from lightning_strategies.comm.ps.wire import pack, slice_of, unpack, write_slice
from lightning_strategies.comm.rpc import call_host

__all__ = ["HierarchicalOverlappedPush"]


class _BucketLayout:
    """One bucket's place in the node's buffers: per chunk ``j`` its rows (shard, index in the shard's plan,
    slice, offset), then one presence flag per row, each chunk padded to the longest."""

    def __init__(self, tensors: Iterable[int], entries: Sequence[Sequence[tuple[int, Slice, int]]]) -> None:
        mine = set(tensors)
        self.rows: list[list[tuple[int, int, Slice, int]]] = []
        for chunk in entries:
            rows, offset, index = [], 0, dict[int, int]()
            for s, sl, _ in chunk:
                k = index[s] = index.get(s, -1) + 1  # the slices of a shard come in its plan's order
                if sl.tensor in mine:
                    rows.append((s, k, sl, offset))
                    offset += sl.numel
            self.rows.append(rows)
        self.values_numel = [sum(sl.numel for _, _, sl, _ in rows) for rows in self.rows]
        self.chunk_numel = max(n + len(rows) for n, rows in zip(self.values_numel, self.rows, strict=True))


class HierarchicalOverlappedPush(OverlappedPush):
    """A worker's bucketed hierarchical push during backward and per-module all-gather before each forward.

    Wired up as :class:`~lightning_strategies.comm.ps.buckets.OverlappedPush` (the same hooks and calls).
    Every wait is bounded: for the shards' replies by the client's RPC timeout, for the node's collectives
    by the node group's timeout.

    Args:
        client: the worker's hierarchical client (its node group carries the collectives).
        lrs, bucket_cap_mb, first_bucket_mb, history: as for ``OverlappedPush``.
    """

    client: HierarchicalParameterServerClient

    def __init__(
        self, client: HierarchicalParameterServerClient, lrs: Callable[[], Sequence[float]], **options: Any
    ) -> None:
        super().__init__(client, lrs, **options)  # bucket_cap_mb, first_bucket_mb, history: as OverlappedPush's
        pl = client.push_layout
        self._layouts = [_BucketLayout(bucket.tensors, pl.entries) for bucket in self.buckets]
        like = client.params[0] if client.params else torch.empty(0)
        # per bucket: the node's buffer (in: gradients, out: every chunk's values) and this rank's chunk
        self._buffers = [like.new_zeros(pl.local_size * lay.chunk_numel) for lay in self._layouts]
        self._chunks = [like.new_zeros(lay.chunk_numel) for lay in self._layouts]
        # where each slice of this rank's shards sits: (shard, index in its plan) -> (bucket, offset in the chunk)
        self._place = {
            (s, k): (b, off) for b, lay in enumerate(self._layouts) for s, k, _, off in lay.rows[client.local]
        }
        self._next = 0  # the next bucket to reduce in the node
        self._reducing: dict[int, Any] = {}  # launched reduce-scatters not pushed yet, in launch order
        self._due: set[int] = set()  # buckets whose values of the last step have not landed
        self._gathers: dict[int, Any] | None = None  # their all-gathers, once started

    # -- backward: reduce in the node, push across -----------------------------------------------

    def _push(self, b: int) -> None:
        self._pushed[b] = True
        while self._next < len(self.buckets) and self._pushed[self._next]:
            if self._next > 0:  # one bucket in flight in the node: its push leaves before the next is reduced
                self._send_reduced(wait=True)
            self._reduce(self._next)
            self._next += 1
        self._send_reduced(wait=False)

    def grad_ready(self, index: int) -> None:
        """As ``OverlappedPush``'s, also pushing every bucket whose reduce-scatter has ended."""
        super().grad_ready(index)
        if self.enabled and self._reducing:
            self._send_reduced(wait=False)

    def _drain(self) -> None:
        self._send_reduced(wait=True)

    def _reduce(self, b: int) -> None:
        self._group()  # raises after close()
        lay, buf, n = self._layouts[b], self._buffers[b], self._layouts[b].chunk_numel
        buf.zero_()
        present: list[int] = []
        with torch.no_grad():
            for j, rows in enumerate(lay.rows):
                for r, (_, _, sl, off) in enumerate(rows):
                    g = self.client.params[sl.tensor].grad
                    if g is not None:
                        buf[j * n + off : j * n + off + sl.numel].copy_(slice_of(g, sl).reshape(-1))
                        present.append(j * n + lay.values_numel[j] + r)
            # divided before the sum, as DDP's reducer (and the one-shot hierarchical push) does
            buf.div_(len(self.client.plan))
            if present:  # flags after the division: their sum counts the node's workers with a gradient
                buf[torch.tensor(present, device=buf.device)] = 1
        timeline = self._pushing
        assert timeline is not None
        if timeline.first_node_reduce is None:
            timeline.first_node_reduce = time.perf_counter()
        self._reducing[b] = self.client.reduce_in_node(buf, self._chunks[b], async_op=True)

    def _send_reduced(self, *, wait: bool) -> None:
        """Push the reduced buckets in launch order: all (``wait``), or those whose reduce-scatter has ended."""
        while self._reducing:
            b, work = next(iter(self._reducing.items()))
            if not wait and not work.is_completed():
                return
            work.wait()
            del self._reducing[b]
            self.client.take_chunk(self._buffers[b], self._chunks[b])
            self._send(b)

    def _send(self, b: int) -> None:
        client, timeline = self.client, self._pushing
        assert timeline is not None
        lay, chunk, j = self._layouts[b], self._chunks[b], client.local
        rows = lay.rows[j]
        if not rows:
            return
        # one host read per bucket: whether any worker of the node has a gradient of each slice
        flags = (chunk[lay.values_numel[j] : lay.values_numel[j] + len(rows)] > 0).tolist()
        by_shard: dict[int, tuple[list[int], list[Tensor | None]]] = {}
        for (s, k, sl, off), flag in zip(rows, flags, strict=True):
            ks, parts = by_shard.setdefault(s, ([], []))
            ks.append(k)
            parts.append(chunk[off : off + sl.numel] if flag else None)  # as the one-shot push: None if none had one
        lrs = list(self._lrs())
        for s, (ks, parts) in by_shard.items():
            packed = pack(parts)  # a copy: the chunk takes the values of the next all-gather
            client.stats.bytes_sent += packed.nbytes
            client.stats.calls += 1
            if client.push_layout.node_of_shard(s) != client.node:
                client.stats.inter_node_bytes_sent = (client.stats.inter_node_bytes_sent or 0) + packed.nbytes
            self._parts.setdefault(s, []).append(call_host(
                s, _rpc_push, s, client.node, client.step, packed, lrs, ks,
                local=local_shard(s) is not None, timeout=client.rpc_timeout,
            ))  # fmt: skip
            timeline.bytes_pushed += packed.nbytes
            if timeline.backward_end is None:
                timeline.bytes_before_backward_end += packed.nbytes
        if timeline.first_push is None:
            timeline.first_push = time.perf_counter()

    def flush(self) -> None:
        """As ``OverlappedPush``'s; every bucket's values are then due (each needs the node's all-gather)."""
        super().flush()
        self._next = 0
        self._due = set(range(len(self.buckets)))
        self._stale = {i for b in self._due for i in self.buckets[b].tensors}
        self._gathers = None

    # -- the next forward: all-gather in the node what each module needs -------------------------

    # wait_for / settle (OverlappedPush's) land buckets here
    def _due_units(self) -> AbstractSet[int]:
        return self._due

    def _units_of(self, tensors: Iterable[int]) -> set[int]:
        return {self._bucket_of[i] for i in tensors if i in self._bucket_of}

    def _land_units(self, units: set[int]) -> None:
        self._land_buckets(units)

    def settle_if_arrived(self) -> bool:
        """Land the last step's values if every bucket's all-gather has ended, without waiting (and
        without starting a collective a lost node peer would never join); else forget them."""
        gathers = self._gathers
        ended = gathers is not None and all(w.is_completed() for w in gathers.values())
        done = not self._pushing and (not self._due or ended)
        if done:
            self.settle()
        self.drop()
        return done

    def drop(self) -> None:
        """Forget the replies, pushes and node collectives in flight (the run failed: they may never end)."""
        super().drop()
        self._next, self._reducing, self._due, self._gathers = 0, {}, set(), None

    def _land_buckets(self, buckets: set[int]) -> None:
        start = time.perf_counter()
        try:
            gathers = self._gathers if self._gathers is not None else self._start_gathers()
            timeline = self.timeline[-1]
            for b in sorted(buckets, reverse=True):
                gathers.pop(b).wait()
                self._write(b)
                self._due.discard(b)
                timeline.pull_landed[b] = time.perf_counter()
        except BaseException:
            self.drop()
            raise
        self._stale = {i for i in self._stale if self._bucket_of[i] in self._due}
        waited = time.perf_counter() - start
        self.client.last_wait_seconds = waited
        self.client.stats.seconds += waited

    def _start_gathers(self) -> dict[int, Any]:
        """This rank's shards' values into the chunks, then every bucket's all-gather, the first layers' first."""
        client = self.client
        replies = client._wait_all(self._in_flight, abort=self._aborted)
        self._in_flight = {}
        with torch.no_grad():
            for s, parts in replies.items():
                # a node's last part is answered with the shard's values (these shards answer no part alone)
                reply = next(r for r in parts if r.values is not None)
                client.last_server_bytes[s] = reply.step_bytes
                slices = client.plan[s]
                values = unpack(reply.values, [slice_of(client.params[sl.tensor], sl) for sl in slices])
                for k, (sl, v) in enumerate(zip(slices, values, strict=True)):
                    b, off = self._place[(s, k)]
                    if v is not None:
                        self._chunks[b][off : off + sl.numel].copy_(v.reshape(-1))
                client.stats.bytes_received += reply.values.nbytes
                if client.push_layout.node_of_shard(s) != client.node:
                    received = (client.stats.inter_node_bytes_received or 0) + reply.values.nbytes
                    client.stats.inter_node_bytes_received = received
        group = self._group()
        self._gathers = {}
        for b in reversed(range(len(self.buckets))):  # the last bucket holds the first layers
            self._gathers[b] = dist.all_gather_single(self._buffers[b], self._chunks[b], group=group, async_op=True)
            client._count_node_collective(self._chunks[b])
        return self._gathers

    def _write(self, b: int) -> None:
        lay, buf, n = self._layouts[b], self._buffers[b], self._layouts[b].chunk_numel
        with torch.no_grad():
            for j, rows in enumerate(lay.rows):
                for _, _, sl, off in rows:
                    write_slice(self.client.params[sl.tensor], sl, buf[j * n + off : j * n + off + sl.numel])

    def _group(self) -> dist.ProcessGroup:
        if self.client.group is None:
            raise RuntimeError(
                f"worker {self.client.worker}: hierarchical push after close(): its node's group is gone (the "
                "run failed or was torn down). Fix: start a new fit."
            )
        return self.client.group
