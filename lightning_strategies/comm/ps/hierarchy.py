"""Hierarchical push: reduce inside the node, push across nodes once per node, all-gather the values back.

On ``N`` nodes of ``L`` processes a flat push sends every worker's gradients to every shard: ``2(P-1)``
remote messages per worker and step, and a node's NIC carries ``L`` times a ring's bytes. Here shard ``s``
is still hosted by rank ``s``, and local rank ``j``'s *chunk* is the union of the shards hosted by local rank
``j`` of every node. Each step:

1. every worker writes its gradients, divided by ``P`` as DDP's reducer does, into one buffer laid out
   chunk by chunk (each chunk padded to the longest, so one equal-size collective serves);
2. a reduce-scatter inside the node (gloo and NCCL both take ``reduce_scatter_single``) leaves local rank
   ``j`` its chunk summed over the node;
3. local rank ``j`` pushes each of its ``N`` shards its part (one push per shard and node: the shard's barrier
   waits for ``N`` pushers and sums without dividing again);
4. the replies' values fill the chunk, and an all-gather inside the node gives every worker every value.

Messages per worker and step: ``2(N-1)`` remote instead of ``2(P-1)``. A node ``n`` hosting the shards of
``B_n`` bytes (of ``B``) sends ``B - B_n`` bytes of pushes and ``(N-1) B_n`` of replies per step, and receives
as much: ``2B(N-1)/N`` each way when the shards are even, a ring's bytes (:func:`node_nic_bytes`).
Here the push happens after the whole backward; :mod:`.hierarchy_overlap` runs the same steps per bucket
during backward (``ParameterServerStrategy(overlap=True)``, the default).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_strategies.comm.ps.client import ParameterServerClient
from lightning_strategies.comm.ps.hosting import _rpc_push, local_shard
from lightning_strategies.comm.ps.plan import Slice
from lightning_strategies.comm.ps.shard import ShardReply
from lightning_strategies.comm.ps.wire import Packed, pack, slice_of, unpack, write_slice
from lightning_strategies.comm.ring.layout import NodeLayout
from lightning_strategies.comm.rpc import call_host

__all__ = ["HierarchicalParameterServerClient", "PushLayout", "node_nic_bytes"]


class PushLayout:
    """Where each shard's elements sit in the node's reduce-scatter buffer.

    Args:
        plan: per shard, its slices; shard ``s`` is hosted by global rank ``s``.
        layout: which ranks share a node; every rank must host a shard (``len(plan) == layout.world``).

    Raises:
        ValueError: the nodes differ in size, or the plan has a shard count other than the world size.
    """

    def __init__(self, plan: Sequence[Sequence[Slice]], layout: NodeLayout) -> None:
        layout.require_uniform()
        if len(plan) != layout.world:
            raise ValueError(
                f"PushLayout: found a plan of {len(plan)} shards for {layout.world} processes: expected one shard "
                "per process, because local rank j pushes the shards of local rank j on every node. Fix: pass "
                "num_servers=None (one per process), or hierarchical=False."
            )
        self.layout = layout
        self.plan = [list(p) for p in plan]
        self.num_nodes = layout.num_nodes
        self.local_size = layout.local_size
        #: ``chunk_shards[j][n]``: the shard hosted by local rank ``j`` of node ``n``
        self.chunk_shards = [[layout.nodes[n][j] for n in range(self.num_nodes)] for j in range(self.local_size)]
        # per chunk: (shard, slice, offset in the chunk) for every slice, then one presence flag per slice
        self.entries: list[list[tuple[int, Slice, int]]] = []
        for shards in self.chunk_shards:
            offset, rows = 0, []
            for s in shards:
                for sl in self.plan[s]:
                    rows.append((s, sl, offset))
                    offset += sl.numel
            self.entries.append(rows)
        self.values_numel = [sum(sl.numel for _, sl, _ in rows) for rows in self.entries]
        #: elements of one chunk in the buffer: the longest chunk's values and presence flags
        self.chunk_numel = max(n + len(rows) for n, rows in zip(self.values_numel, self.entries, strict=True))

    def node_of_shard(self, shard: int) -> int:
        """The node hosting ``shard``."""
        return self.layout.node_of(shard)


def node_nic_bytes(shard_bytes: Sequence[int], layout: NodeLayout, *, hierarchical: bool) -> list[int]:
    """Payload bytes each node's NIC sends per step (and receives: the traffic is symmetric) under the push.

    With ``B`` the bytes of every shard and ``B_n`` those hosted on node ``n``: hierarchical, node ``n`` pushes
    ``B - B_n`` (one push per remote shard) and answers ``N - 1`` pushers per shard it hosts, ``(N-1) B_n``;
    flat, each of its ``L`` workers pushes ``B - B_n`` and its shards answer ``L (N-1)`` remote workers:
    ``L`` times as much. Even shards (``B_n = B/N``) give ``2B(N-1)/N`` and ``L x 2B(N-1)/N``.

    Args:
        shard_bytes: payload bytes of each shard's slices (shard ``s`` hosted by rank ``s``).
    """
    total = sum(shard_bytes)
    nic = []
    for ranks in layout.nodes:
        here = sum(shard_bytes[r] for r in ranks if r < len(shard_bytes))
        fan = len(ranks) if not hierarchical else 1
        nic.append(fan * (total - here) + fan * (layout.num_nodes - 1) * here)
    return nic


class HierarchicalParameterServerClient(ParameterServerClient):
    """A worker's handle on the shards that pushes through its node (the module docstring has the steps).

    Args:
        worker: this worker's global rank.
        params: the worker's trainable tensors in the optimizer's flat order; one dtype and device.
        plan: per shard, its slices (one shard per process).
        layout: which ranks share a node.
        intra_group: this node's process group (the reduce-scatter's and all-gather's).
        timeout: as for :class:`ParameterServerClient`.

    Raises:
        ValueError: for parameters of more than one dtype or device (one buffer carries them all), or a
            plan :class:`PushLayout` refuses.
    """

    def __init__(
        self,
        worker: int,
        params: Sequence[Tensor],
        plan: Sequence[Sequence[Slice | int]],
        *,
        layout: NodeLayout,
        intra_group: dist.ProcessGroup,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(worker, params, plan, timeout=timeout)
        kinds = sorted({(str(p.dtype), str(p.device)) for p in self.params})
        if len(kinds) > 1:
            raise ValueError(
                f"hierarchical push: found parameters of {kinds} (dtype, device): expected one dtype on one "
                "device, because one buffer carries the node's reduce-scatter. Fix: cast the model to one dtype, "
                "or pass hierarchical=False."
            )
        self.push_layout = PushLayout(self.plan, layout)
        self.node = layout.node_of(worker)
        self.local = layout.nodes[self.node].index(worker)
        self.group: dist.ProcessGroup | None = intra_group
        self.stats.inter_node_bytes_sent = 0
        self.stats.inter_node_bytes_received = 0
        like = self.params[0] if self.params else torch.empty(0)
        n = self.push_layout.chunk_numel
        self._buffer = like.new_zeros(self.push_layout.local_size * n)
        self._chunk = like.new_zeros(n)
        # gloo's reduce-scatter took 1.7x its all-reduce of the same buffer (2 processes, 4 MB, measured on
        # 2 loaded cores): on gloo the node all-reduces the buffer and each rank keeps its chunk of the sum
        self.node_all_reduce = dist.get_backend(intra_group) == "gloo"

    def reduce_in_node(self, buffer: Tensor, chunk: Tensor, *, async_op: bool = False) -> Any:
        """Sum ``buffer`` over the node into this rank's ``chunk`` (its ``local`` slice of the buffer):
        a reduce-scatter, or on gloo an all-reduce; ``async_op``: the work, after whose ``wait`` the
        chunk is :meth:`take_chunk`'s to fill."""
        assert self.group is not None
        if self.node_all_reduce:
            work = dist.all_reduce(buffer, group=self.group, async_op=async_op)
            self._count_node_collective(chunk, times=2)
        else:
            work = dist.reduce_scatter_single(chunk, buffer, group=self.group, async_op=async_op)
            self._count_node_collective(chunk)
        if not async_op:
            self.take_chunk(buffer, chunk)
        return work

    def take_chunk(self, buffer: Tensor, chunk: Tensor) -> None:
        """After :meth:`reduce_in_node` has ended: this rank's part of the node's sum into ``chunk``."""
        if self.node_all_reduce:
            n = chunk.numel()
            chunk.copy_(buffer[self.local * n : (self.local + 1) * n])

    def push_pull(self, lrs: Sequence[float]) -> None:
        """Reduce inside the node, push this rank's chunk to its shards, all-gather the values in the node.

        A collective of the node's group (every worker of the node calls it each step), then this worker's
        only synchronisation with the other nodes.

        Raises:
            RuntimeError: naming the shard and its host rank when a shard fails or times out; the node's
                collective raises as the backend does when a node peer is gone.
        """
        start = time.perf_counter()
        if self.group is None:
            raise RuntimeError(
                f"worker {self.worker}: hierarchical push after close(): its node's group is gone (the run "
                "failed or was torn down). Fix: start a new fit."
            )
        pl = self.push_layout
        n, world = pl.chunk_numel, len(self.plan)
        self._fill_buffer(world)
        self.reduce_in_node(self._buffer, self._chunk)
        replies = self._call_shards_of_chunk(list(lrs))
        for s, reply in replies.items():
            self.last_server_bytes[s] = reply.step_bytes
            if reply.values is not None:
                self._take_values(s, reply.values)
        dist.all_gather_single(self._buffer, self._chunk, group=self.group)
        self._count_node_collective()
        with torch.no_grad():
            for j, rows in enumerate(pl.entries):
                base = j * n
                for _, sl, off in rows:
                    write_slice(self.params[sl.tensor], sl, self._buffer[base + off : base + off + sl.numel])
        self._end_step(start)

    def close(self) -> None:
        """Drop the node's group, so that destroying it closes its connections (no push after this)."""
        self.group = None

    def _fill_buffer(self, world: int) -> None:
        pl = self.push_layout
        n = pl.chunk_numel
        buf = self._buffer
        buf.zero_()
        present: list[tuple[int, int]] = []
        with torch.no_grad():
            for j, rows in enumerate(pl.entries):
                base = j * n
                for k, (_, sl, off) in enumerate(rows):
                    g = self.params[sl.tensor].grad
                    if g is None:
                        continue
                    buf[base + off : base + off + sl.numel].copy_(slice_of(g, sl).reshape(-1))
                    present.append((j, k))
            # divided before the sum, as DDP's reducer divides each rank's gradient by the world size
            buf.div_(world)
            for j, k in present:  # flags after the division: their sum counts the node's workers with a gradient
                buf[j * n + pl.values_numel[j] + k] = 1

    def _call_shards_of_chunk(self, lrs: list[float]) -> dict[int, ShardReply]:
        pl = self.push_layout
        rows = pl.entries[self.local]
        # one host read: whether any worker of the node has a gradient of each slice
        flags = (self._chunk[pl.values_numel[self.local] : pl.values_numel[self.local] + len(rows)] > 0).tolist()
        by_shard: dict[int, list[Tensor | None]] = {}
        for k, (s, sl, off) in enumerate(rows):
            # a tensor no worker of the node has a gradient for stays None, as in a flat push
            part = self._chunk[off : off + sl.numel] if flags[k] else None
            by_shard.setdefault(s, []).append(part)
        futures = {}
        for s, parts in by_shard.items():
            packed = pack(parts)
            self.stats.bytes_sent += packed.nbytes
            remote = pl.node_of_shard(s) != self.node
            if remote:
                self.stats.inter_node_bytes_sent = (self.stats.inter_node_bytes_sent or 0) + packed.nbytes
            futures[s] = call_host(
                s, _rpc_push, s, self.node, self.step, packed, lrs,
                local=local_shard(s) is not None, timeout=self.rpc_timeout,
            )  # fmt: skip
        self.stats.calls += len(futures)
        return self._wait_all(futures)

    def _take_values(self, s: int, values: Packed) -> None:
        pl = self.push_layout
        rows = [(sl, off) for shard, sl, off in pl.entries[self.local] if shard == s]
        views = [self._chunk[off : off + sl.numel] for sl, off in rows]
        with torch.no_grad():
            for view, v in zip(views, unpack(values, views), strict=True):
                if v is not None:
                    view.copy_(v)
        self.stats.bytes_received += values.nbytes
        if pl.node_of_shard(s) != self.node:
            self.stats.inter_node_bytes_received = (self.stats.inter_node_bytes_received or 0) + values.nbytes

    def _count_node_collective(self, chunk: Tensor | None = None, *, times: int = 1) -> None:
        # a reduce-scatter (or all-gather) moves L-1 chunks in and out of each member, whatever the algorithm
        # (an all-reduce: twice that)
        chunk = self._chunk if chunk is None else chunk
        moved = times * (self.push_layout.local_size - 1) * chunk.numel() * chunk.element_size()
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
