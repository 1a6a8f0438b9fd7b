"""Hierarchical asynchronous SGD: synchronous inside a node, asynchronous across nodes (no Lightning import).

On ``N`` nodes of ``L`` processes a flat asynchronous push sends ``2(P-1)`` messages per worker and step,
and a node's NIC carries ``L`` times a ring's bytes. Here the *node* is the asynchronous worker:

1. the coordinator leases one *unit* (``L`` consecutive batches of the epoch, :class:`NodePlan`) per node
   step; the node's processes split it (:func:`node_part`: in a full unit local rank ``j`` trains the unit's
   batch ``j``, exactly the batch it would train alone), so every batch of an epoch is trained once;
2. each process writes its gradient, weighted by its share of the unit's samples (``1/L`` in a full unit),
   into the node's buffer, and the node sums it with the hierarchical parameter server's in-node collective
   (:meth:`~lightning_strategies.comm.ps.hierarchy.HierarchicalParameterServerClient.reduce_in_node`: an
   all-reduce on gloo, a reduce-scatter on NCCL): the node's gradient is the mean over the unit's samples;
3. local rank ``j`` pushes its chunk (the shards hosted by local rank ``j`` of every node) to those ``N``
   shards, which apply it at once with no barrier across nodes (:class:`AsyncParameterShard`, one worker
   per node), and takes their new values;
4. an all-gather inside the node gives every process every value, so the node's replicas stay equal.

Staleness, clocks and the bound are the node's: its ``L`` processes push the same steps together. A node
``n`` hosting ``B_n`` of the shards' ``B`` payload bytes sends ``B - B_n`` of pushes and ``(N-1) B_n`` of
replies per node step: :func:`~lightning_strategies.comm.ps.hierarchy.node_nic_bytes` with
``hierarchical=True``, a ring's ``2B(N-1)/N`` for even shards, each way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_strategies.comm.async_.messages import DataPlan
from lightning_strategies.comm.async_ps import AsyncParameterServerClient, AsyncReply, _rpc_async_pull, _rpc_async_push
from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient
from lightning_strategies.comm.ps.hosting import local_shard
from lightning_strategies.comm.ps.wire import pack, slice_of, write_slice
from lightning_strategies.comm.rpc import call_host

__all__ = ["HierarchicalAsyncClient", "NodePlan", "node_part"]


@dataclass(frozen=True)
class NodePlan(DataPlan):
    """The epoch in *units* of ``unit`` consecutive batches of the base plan (the loader's batching): what
    a node leases per step when its ``unit`` processes push as one worker.

    Attributes:
        unit: batches per unit (the processes per node).
    """

    unit: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.unit < 1:
            raise ValueError(f"NodePlan(unit={self.unit}): expected at least 1 batch per unit")

    @property
    def base(self) -> DataPlan:
        """The loader's plan, batch by batch."""
        return DataPlan(self.num_samples, self.batch_size, self.drop_last, self.shuffle, self.seed)

    @property
    def num_batches(self) -> int:
        """Units in one epoch (the last one may hold fewer than ``unit`` batches)."""
        return math.ceil(self.base.num_batches / self.unit)

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's units, each the concatenated indices of its batches, in the base plan's order."""
        base = self.base.batches(epoch)
        return [[i for batch in base[u : u + self.unit] for i in batch] for u in range(0, len(base), self.unit)]


def node_part(indices: Sequence[int], parts: int, part: int) -> tuple[list[int], float]:
    """Part ``part`` of a unit split among ``parts`` processes, and its weight in the node's gradient.

    The unit is cut into ``parts`` contiguous pieces whose sizes differ by at most one; a full unit of
    ``parts`` equal batches gives each process one batch. The weight is the piece's share of the unit's
    samples, so that the weighted sum of the processes' mean-loss gradients is the unit's mean-loss
    gradient. A unit with fewer samples than processes leaves some empty: those train the unit's first
    sample with weight 0 (they must take part in the node's collectives; their gradient counts for nothing).

    Raises:
        ValueError: for an empty unit or a part outside ``[0, parts)``.
    """
    if not indices or not 0 <= part < parts:
        raise ValueError(f"node_part: found part {part} of {parts} of a unit of {len(indices)} samples")
    n = len(indices)
    size, rest = divmod(n, parts)
    start = part * size + min(part, rest)
    count = size + (1 if part < rest else 0)
    if count == 0:
        return [indices[0]], 0.0
    return list(indices[start : start + count]), count / n


class HierarchicalAsyncClient(HierarchicalParameterServerClient, AsyncParameterServerClient):
    """A process's handle on the asynchronous shards, pushing through its node (the module docstring).

    :meth:`push` and :meth:`pull` are collectives of the node's group: every process of the node calls them
    at the same steps. The shards see worker :attr:`node` (one per node), so staleness and clocks are the
    node's. Set :attr:`weight` before each step's push.

    Args:
        worker: this process's global rank.
        params, plan, layout, intra_group, timeout: as for
            :class:`~lightning_strategies.comm.ps.hierarchy.HierarchicalParameterServerClient`.
    """

    #: this process's share of the node step's samples (:func:`node_part`): its gradient's weight in the node's sum
    weight: float = 1.0

    def push(self, grads: Sequence[Tensor | None], lrs: Sequence[float], *, pull: bool = True) -> None:
        """Sum :attr:`weight` x ``grads`` over the node, push this process's chunk, all-gather the values.

        Args:
            grads: this process's gradients (flat optimizer order); ``None``: none for that tensor (a skipped
                step: all ``None``, it adds nothing to the node's sum).
            pull: must be true: the node's values come back with every push (its replicas stay equal).

        Raises:
            ValueError: for ``pull=False``.
            RuntimeError: naming the shard and its host rank when a shard fails or times out.
        """
        if not pull:
            raise ValueError("HierarchicalAsyncClient.push(pull=False): the node pulls with every push")
        start = time.perf_counter()
        self._require_group()
        self._fill_weighted(grads, self.weight)
        self.reduce_in_node(self._buffer, self._chunk)
        replies = self._call_chunk(pushing=True, lrs=list(lrs))
        self.last_staleness = [r.staleness for r in replies.values()]
        self._gather_values(replies)
        self._end_step(start)

    def pull(self) -> None:
        """Every shard's current values: this process's chunk from its shards, then an all-gather in the node."""
        start = time.perf_counter()
        self._require_group()
        self._gather_values(self._call_chunk(pushing=False, lrs=[]))
        self.stats.seconds += time.perf_counter() - start

    def _require_group(self) -> None:
        if self.group is None:
            raise RuntimeError(
                f"worker {self.worker}: hierarchical async push after close(): its node's group is gone (the "
                "run failed or was torn down). Fix: start a new fit."
            )

    def _fill_weighted(self, grads: Sequence[Tensor | None], weight: float) -> None:
        pl = self.push_layout
        n = pl.chunk_numel
        buf = self._buffer
        buf.zero_()
        with torch.no_grad():
            for j, rows in enumerate(pl.entries):
                base = j * n
                for k, (_, sl, off) in enumerate(rows):
                    g = grads[sl.tensor]
                    if g is None:
                        continue
                    view = buf[base + off : base + off + sl.numel]
                    view.copy_(slice_of(g, sl).reshape(-1)).mul_(weight)
                    # presence flag: the node's sum counts the processes with a gradient of the slice
                    buf[base + pl.values_numel[j] + k] = 1

    def _call_chunk(self, *, pushing: bool, lrs: list[float]) -> dict[int, AsyncReply]:
        pl = self.push_layout
        rows = pl.entries[self.local]
        flags = [False] * len(rows)
        if pushing:  # one host read: whether any process of the node has a gradient of each slice
            flags = (self._chunk[pl.values_numel[self.local] : pl.values_numel[self.local] + len(rows)] > 0).tolist()
        by_shard: dict[int, list[Tensor | None]] = {}
        for k, (s, sl, off) in enumerate(rows):
            by_shard.setdefault(s, []).append(self._chunk[off : off + sl.numel] if flags[k] else None)
        futures = {}
        for s, parts in by_shard.items():
            local = local_shard(s) is not None
            if pushing:
                packed = pack(parts)
                self.stats.bytes_sent += packed.nbytes
                if pl.node_of_shard(s) != self.node:
                    self.stats.inter_node_bytes_sent = (self.stats.inter_node_bytes_sent or 0) + packed.nbytes
                futures[s] = call_host(
                    s, _rpc_async_push, s, self.node, packed, lrs, True, local=local, timeout=self.rpc_timeout
                )
            else:
                futures[s] = call_host(s, _rpc_async_pull, s, self.node, local=local, timeout=self.rpc_timeout)
        self.stats.calls += len(futures)
        return self._wait_all(futures)

    def _gather_values(self, replies: dict[int, AsyncReply]) -> None:
        for s, reply in replies.items():
            self.last_server_bytes[s] = reply.step_bytes
            if reply.values is not None:
                self._take_values(s, reply.values)
        assert self.group is not None
        torch.distributed.all_gather_single(self._buffer, self._chunk, group=self.group)
        self._count_node_collective()
        pl = self.push_layout
        n = pl.chunk_numel
        with torch.no_grad():
            for j, rows in enumerate(pl.entries):
                base = j * n
                for _, sl, off in rows:
                    write_slice(self.params[sl.tensor], sl, self._buffer[base + off : base + off + sl.numel])
