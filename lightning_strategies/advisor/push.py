"""Who sends what to whom in a parameter-server step: the flat push and the hierarchical one.

Pure arithmetic (no torch), as :mod:`~lightning_strategies.advisor.schedule` is for the pipeline:
the scale model's ``ps``, ``ps_flat`` and ``async`` terms take their messages and bytes from here,
and ``tests/unit/test_scale_model_ps.py`` holds them to the formulas written out by hand.

P processes, L per node, N = P / L nodes, D gradient bytes; shard s (1/P of the model) on rank s.

flat (``ps_flat``: ``hierarchical=False``; ``async`` on one node): every worker pushes D/P to each of
    the P-1 other shards and its shard answers the P-1 other workers: 2(P-1) messages and
    2(P-1)/P x D sent per worker, L-1 of its peers on its node and P-L off it. A node's NIC
    carries its L workers' off-node messages: 2L(P-L)/P x D each way, L times a ring's.
hierarchical (``ps``, and ``async`` with the node as its worker, on more than one node of more
    than one process): a reduce-scatter inside the node leaves local rank j the node's sum of chunk
    j (the slices of the shards {nL + j}); it pushes D/P to each of the N-1 remote shards of its
    chunk (the one on its own rank is a local call) and its shard answers the N-1 remote pushers
    (the barrier waits for N pushers, one per node; async's shard applies each on arrival); an
    all-gather inside the node gives every rank every value. Per worker 2(N-1) messages and
    2(N-1)/N x D/L across nodes, 2(L-1)/L x D inside the node (the backend's reduce-scatter and
    all-gather); a node's NIC 2(N-1)/N x D each way, the hierarchical ring's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PushTraffic", "push_traffic"]


@dataclass(frozen=True)
class PushTraffic:
    """One worker's messages and bytes in a ps step (it is a worker and a shard at once).

    Attributes:
        hierarchical: whether the node reduces before pushing (and gathers after pulling).
        local: processes per node (L).
        nodes: nodes (N).
        pushers: the pushes a shard's barrier waits for (P flat, N hierarchical).
        peers_on_node: RPC peers a worker pushes to on its own node (L-1 flat, 0 hierarchical).
        peers_off_node: RPC peers on other nodes (P-L flat, N-1 hierarchical).
        message_bytes: one push or one reply (D/P).
        node_bytes: what a worker sends inside its node through the collective backend (the
            reduce-scatter and the all-gather, 2(L-1)/L x D hierarchical; on gloo an all-reduce and the
            all-gather, 3(L-1)/L x D; 0 flat).
    """

    hierarchical: bool
    local: int
    nodes: int
    pushers: int
    peers_on_node: int
    peers_off_node: int
    message_bytes: float
    node_bytes: float

    @property
    def messages(self) -> int:
        """RPC messages a worker sends per step: a push to every peer and a reply to every peer."""
        return 2 * (self.peers_on_node + self.peers_off_node)

    @property
    def inter_sent_bytes(self) -> float:
        """Bytes a worker sends to other nodes per step (its pushes and its shard's replies)."""
        return 2 * self.peers_off_node * self.message_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes a worker sends per step, RPC and collectives together."""
        return self.messages * self.message_bytes + self.node_bytes

    @property
    def nic_bytes(self) -> float:
        """Bytes leaving a node per step (its L workers' off-node bytes; 0 on one node)."""
        return self.local * self.inter_sent_bytes if self.nodes > 1 else 0.0

    @property
    def link_bytes(self) -> float:
        """Bytes on the busiest single link: one peer's push and reply, the node's collectives or its NIC."""
        if self.messages == 0:
            return self.node_bytes
        return max(2 * self.message_bytes, self.node_bytes, self.nic_bytes)


def push_traffic(
    world: int, local_size: int, grad_bytes: float, *, hierarchical: bool = True, node_all_reduce: bool = False
) -> PushTraffic:
    """The traffic of a ps step at ``world`` processes, ``local_size`` per node.

    Args:
        world: P.
        local_size: processes per node (L); a world smaller than it is one node.
        grad_bytes: D.
        hierarchical: reduce inside each node before pushing, where there is more than one node of
            more than one process (the ps strategy's default); ``False``: every worker pushes to
            every shard (``ps_flat``, async on one node).
        node_all_reduce: the node sums with an all-reduce of the whole buffer (gloo, ``comm.ps.hierarchy``)
            rather than a reduce-scatter: a worker sends 3(L-1)/L x D inside its node, not 2(L-1)/L x D.

    Raises:
        ValueError: hierarchical on nodes that are not whole (P not a multiple of L).
    """
    if world < 1 or local_size < 1:
        raise ValueError(f"push_traffic: found P={world}, L={local_size}: expected both >= 1")
    local = min(local_size, world)
    nodes = math.ceil(world / local)
    share = grad_bytes / world
    if not (hierarchical and nodes > 1 and local > 1):
        return PushTraffic(False, local, nodes, world, local - 1, world - local, share, 0.0)
    if world % local:
        raise ValueError(
            f"hierarchical ps needs whole nodes: found P={world} with {local} per node. "
            "Fix: a multiple of the node's processes, or the flat push (ps_flat)"
        )
    node_bytes = (3 if node_all_reduce else 2) * (local - 1) / local * grad_bytes
    return PushTraffic(True, local, nodes, nodes, 0, nodes - 1, share, node_bytes)
