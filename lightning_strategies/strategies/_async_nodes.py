"""``"async"`` on several nodes: whether the node is the asynchronous worker, and the node's control messages.

Kept out of ``async_ps.py`` so that the strategy file stays a list of the hooks it changes; the algorithm is
:mod:`lightning_strategies.comm.async_hierarchy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_strategies.comm.async_ import DataPlan, LeasedBatch
from lightning_strategies.comm.async_hierarchy import HierarchicalAsyncClient, NodePlan, node_part
from lightning_strategies.comm.ps import Slice
from lightning_strategies.comm.ring.layout import NodeLayout, new_hierarchical_groups
from lightning_strategies.strategies._nodes import gather_node_layout, wants_hierarchy
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy

__all__ = ["AsyncNodes", "NodeWorkerStrategy", "plan_async_nodes"]

_NAME = "AsyncParameterServerStrategy"


@dataclass
class AsyncNodes:
    """The nodes of a hierarchical ``"async"`` fit and this process's place in them.

    Attributes:
        control: this node's gloo group for the leader's draws and the bound's decisions (separate from the
            push's group, whose collectives run on the model's device).
    """

    layout: NodeLayout
    rank: int
    control: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None = None

    @property
    def node(self) -> int:
        """This node's index: its worker id for the coordinator and the shards."""
        return self.layout.node_of(self.rank)

    @property
    def local(self) -> int:
        """This process's index inside its node."""
        return self.layout.nodes[self.node].index(self.rank)

    @property
    def leader(self) -> int:
        """The global rank that leases and admits the node's steps (its local rank 0)."""
        return self.layout.nodes[self.node][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def share(self, value: Any) -> Any:
        """The leader's ``value`` on every process of the node (a collective of the node's control group)."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.control)
        return box[0]

    def part(self, batch: LeasedBatch) -> tuple[list[int], float]:
        """This process's samples of a leased unit and their weight (:func:`node_part`)."""
        return node_part(batch.indices, self.layout.local_size, self.local)

    def plan(self, plan: DataPlan) -> NodePlan:
        """The loader's plan in units of one batch per process of a node.

        Raises:
            ValueError: for fewer units than nodes (a node without a step would skip the epoch end).
        """
        nodes = NodePlan(plan.num_samples, plan.batch_size, plan.drop_last, plan.shuffle, plan.seed,
                         unit=self.layout.local_size)  # fmt: skip
        if nodes.num_batches < self.layout.num_nodes:
            raise ValueError(
                f"{_NAME} found {plan.num_batches} training batches per epoch for {self.layout.num_nodes} nodes of "
                f"{self.layout.local_size} processes: expected at least one unit of {self.layout.local_size} batches "
                "per node, because each node trains one batch per process per step. Fix: a smaller batch size, or "
                "hierarchical=False."
            )
        return nodes

    def close(self) -> None:
        """Destroy the control group (its connections close, so a node peer blocked in it fails at once)."""
        for group in (self.control, self.inter):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self.control = self.inter = None


def plan_async_nodes(
    strategy: DDPStrategy,
    hierarchical: bool | None,
    *,
    num_servers: int,
    push_every: int,
    pull_every: int,
    timeout: timedelta | None,
) -> AsyncNodes | None:
    """The nodes of a hierarchical ``"async"`` fit, or ``None`` for the flat one. A collective of the default
    group (the layout's all-gather, the control groups' creation) unless it decides flat from options alone.

    Raises:
        ValueError: under ``hierarchical=True``, what the node's push cannot take: ``num_servers`` below the
            world size, ``push_every`` or ``pull_every`` above 1; under ``None`` or ``True``, uneven nodes.
    """
    if hierarchical is False or strategy.num_nodes < 2:
        if hierarchical:
            rank_zero_info(f"{_NAME}: hierarchical=True on one node: nothing to split, the push is flat")
        return None
    layout = gather_node_layout(strategy, _NAME)
    if not wants_hierarchy(hierarchical, layout):
        return None
    why = []
    if num_servers != layout.world:
        why.append(f"num_servers={num_servers} (expected {layout.world}: local rank j pushes local rank j's shards)")
    if push_every != 1 or pull_every != 1:
        why.append(f"push_every={push_every}, pull_every={pull_every} (expected 1: the node pushes and pulls as one)")
    if why:
        if hierarchical:
            raise ValueError(
                f"{_NAME}(hierarchical=True) on {layout.num_nodes} nodes found {'; '.join(why)}. Fix: drop those "
                "options, or pass hierarchical=False for the flat asynchronous push."
            )
        rank_zero_info(f"{_NAME}: the push is flat on {layout.num_nodes} nodes: {'; '.join(why)}")
        return None
    intra, inter = new_hierarchical_groups(layout, backend="gloo", timeout=timeout)
    return AsyncNodes(layout, dist.get_rank(), intra, inter)


class NodeWorkerStrategy(ParameterServerStrategy):
    """What ``"async"`` adds to ``"ps"`` so that on several nodes the node is the asynchronous worker: the nodes'
    plan at setup, the node's client, the leader's decisions shared in the node (the strategy is
    :class:`~lightning_strategies.AsyncParameterServerStrategy`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hierarchical_option = self._hierarchical  # the user's; ``_hierarchical`` is this fit's
        self._nodes: AsyncNodes | None = None  # this fit's nodes when the node is the worker

    @property
    def _worker_id(self) -> int:
        """The coordinator's and the shards' worker: the node, when it is the worker, else the rank."""
        return self._nodes.node if self._nodes is not None else self.global_rank

    @property
    def _worker_ids(self) -> int:
        """Worker ids the coordinator and the shards count: the nodes, when the node is the worker, else the
        world's ranks (servers included, which push nothing under ``"async_elastic"``)."""
        return self._nodes.layout.num_nodes if self._nodes is not None else self.world_size

    def _plan_nodes(self, *, push_every: int, pull_every: int) -> None:
        """Decide this fit's nodes (a collective of the default group on several nodes)."""
        self._close_nodes()
        self._nodes = plan_async_nodes(
            self, self._hierarchical_option, num_servers=self.num_servers, push_every=push_every,
            pull_every=pull_every, timeout=self._timeout,
        )  # fmt: skip
        self._hierarchical = self._nodes is not None  # the push's groups follow (``plan_push_nodes``)

    @override
    def _start_client(self, params: list[Tensor], plan: list[list[Slice]]) -> None:
        super()._start_client(params, plan)
        push = self._push_nodes
        if push is not None:  # the node's push, to asynchronous shards
            self._client = HierarchicalAsyncClient(
                self.global_rank, params, plan, layout=push.layout, intra_group=push.intra, timeout=self.ps_timeout
            )

    def _node_step(self, batch: LeasedBatch, held: bool, *, bounded: bool) -> bool:
        """Before the node's step on ``batch``: this process's weight in it, and whether to pull first (the
        leader's ``held``, shared under a bound: the node's replicas pull together or not at all)."""
        nodes, client = self._nodes, self._client
        if nodes is None:
            return held
        if isinstance(client, HierarchicalAsyncClient):
            client.weight = nodes.part(batch)[1]
        return bool(nodes.share(held)) if bounded else held

    def _share_in_node(self, value: Any) -> Any:
        """The node leader's ``value`` (``value`` itself when the node is not the worker)."""
        return self._nodes.share(value) if self._nodes is not None else value

    def _close_nodes(self) -> None:
        if self._nodes is not None:
            self._nodes.close()
        self._nodes = None
