"""Which processes share a node, the hierarchical ring's groups, and the ring's bucket size.

Every ring step moves one P-th of the tensor, so at large P a fixed DDP bucket costs per-message latency, not
bytes (25 MiB at P = 256: 510 serial steps of 100 KiB): :func:`ring_bucket_cap_mb` grows it accordingly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_strategies.comm.groups import member_group

__all__ = ["MIN_CHUNK_BYTES", "NodeLayout", "new_hierarchical_groups", "ring_bucket_cap_mb"]

#: Smallest chunk (bytes) a ring step should move. A step costs ``latency + chunk / bandwidth``: at 12.5 GB/s
#: and 5-10 us per message, latency x bandwidth is 60-125 KB, so 256 KiB keeps a step at least two-thirds
#: bandwidth-bound. With DDP's 25 MiB buckets it changes nothing below P = 100.
MIN_CHUNK_BYTES = 256 << 10


@dataclass(frozen=True)
class NodeLayout:
    """Which processes share a node: the global ranks on each node, in local-rank order.

    Built from the launcher's node and local ranks (:meth:`from_ranks`), never from host names; global
    ranks need not be contiguous per node (SLURM's cyclic distribution).

    Attributes:
        nodes: ``nodes[n][i]`` is the global rank of local rank ``i`` on node ``n``.
    """

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks(cls, node_ranks: Sequence[int], local_ranks: Sequence[int]) -> NodeLayout:
        """The layout of processes whose node and local ranks (torchrun's ``GROUP_RANK`` / ``LOCAL_RANK``,
        SLURM's ``SLURM_NODEID`` / ``SLURM_LOCALID``) are given by global rank.

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
        """The processes per node L (``ValueError`` when the nodes run different numbers)."""
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

    A collective (``new_group``): every process of the world calls it with the same layout.

    Raises:
        ValueError: the layout does not cover the world, or its nodes differ in size.
        RuntimeError: torch could not make a group (:func:`~lightning_strategies.comm.groups.member_group`).
    """
    layout.require_uniform()
    if layout.world != dist.get_world_size():
        raise ValueError(
            f"new_hierarchical_groups: found a layout of {layout.world} processes in a world of "
            f"{dist.get_world_size()}: expected the layout of the whole world."
        )
    intra = member_group(
        layout.intra_node_ranks(), backend=backend, timeout=timeout, what="the intra-node ring's group"
    )
    inter = member_group(
        layout.inter_node_ranks(), backend=backend, timeout=timeout, what="the inter-node ring's group"
    )
    return intra, inter


def ring_bucket_cap_mb(bucket_cap_mb: float, world: int, min_chunk_bytes: int = MIN_CHUNK_BYTES) -> float:
    """The DDP bucket size (MiB) that gives each of a ``world``-process ring's chunks ``min_chunk_bytes``.

    ``max(bucket_cap_mb, world x min_chunk_bytes / 2^20)``; ``min_chunk_bytes=0`` keeps ``bucket_cap_mb``.
    """
    if world < 1 or min_chunk_bytes < 0:
        raise ValueError(
            f"ring_bucket_cap_mb: found world={world}, min_chunk_bytes={min_chunk_bytes}: expected world >= 1 "
            "and min_chunk_bytes >= 0."
        )
    return max(float(bucket_cap_mb), world * min_chunk_bytes / float(1 << 20))
