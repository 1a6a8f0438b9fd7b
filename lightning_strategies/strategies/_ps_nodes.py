"""The parameter servers' side of the node layout: whether their push goes hierarchical, and its groups;
whether the workers align each step's pushes (:class:`PushAlignment`); the checks of these push options
(and of ``reply_per_bucket``'s).

Kept out of ``parameter_server.py`` so that the strategy file stays a list of the hooks it changes; the
algorithm itself is :mod:`lightning_strategies.comm.ps.hierarchy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_strategies.comm.groups import new_group
from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient
from lightning_strategies.comm.ps.plan import Slice
from lightning_strategies.comm.ring.layout import NodeLayout, new_hierarchical_groups
from lightning_strategies.strategies._nodes import decide_hierarchy

__all__ = [
    "PushAlignment",
    "PushNodes",
    "check_align_pushes",
    "check_hierarchical",
    "check_reply_per_bucket",
    "close_alignment",
    "close_push_nodes",
    "plan_alignment",
    "plan_push_nodes",
]


@dataclass
class PushNodes:
    """A hierarchical push's nodes and this process's groups (the intra-node one carries its collectives)."""

    layout: NodeLayout
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup

    def pushers_of(self, shard: int) -> list[int]:
        """The ranks pushing to ``shard``: its host's local rank on every node, in node order."""
        local = self.layout.nodes[self.layout.node_of(shard)].index(shard)
        return [ranks[local] for ranks in self.layout.nodes]

    def client(
        self, rank: int, params: Sequence[Tensor], plan: Sequence[Sequence[Slice]], *, timeout: timedelta
    ) -> HierarchicalParameterServerClient:
        """This rank's client, pushing through its node."""
        return HierarchicalParameterServerClient(
            rank, params, plan, layout=self.layout, intra_group=self.intra, timeout=timeout
        )


def _check_node_option(
    strategy_class: type, option: str, value: object, *, none_means: str, supported: str, why_not: str, ps_push: str
) -> None:
    """Raise for a ``None`` / ``True`` / ``False`` option of the push that the strategy cannot take: not a bool or
    ``None``, or ``True`` where the class attribute ``supported`` is false (``why_not`` says why)."""
    name = strategy_class.__name__
    if value is not None and type(value) is not bool:
        raise ValueError(f"{name}({option}={value!r}): expected None ({none_means}), True or False.")
    if value and not getattr(strategy_class, supported, True):
        raise ValueError(
            f"{name}({option}=True): expected None or False, because {why_not}. Fix: drop {option}, or use "
            f"strategy='ps' for the {ps_push}."
        )


def check_hierarchical(strategy_class: type, hierarchical: object) -> None:
    """Raise for a ``hierarchical`` option the strategy cannot take (checked in the constructor)."""
    _check_node_option(
        strategy_class, "hierarchical", hierarchical,
        none_means="hierarchical on more than one node", supported="hierarchical_push",
        why_not="its workers push without a barrier, so there is no step at which a node's gradients could be "
        "summed first",
        ps_push="synchronous, hierarchical push",
    )  # fmt: skip


def plan_push_nodes(
    strategy: DDPStrategy,
    hierarchical: bool | None,
    *,
    num_servers: int,
    backend: str | None,
    timeout: timedelta | None,
) -> PushNodes | None:
    """The nodes of a hierarchical push and its groups, or ``None`` for the flat push. A collective of the
    default group (the layout's all-gather, the groups' creation) unless it decides flat from options alone.

    Raises:
        ValueError: under ``hierarchical`` not ``False``, nodes of different sizes; under ``True``,
            ``num_servers`` below the world size (local rank j pushes the shard of local rank j on every node).
    """
    name = "parameter_server"
    if hierarchical is False or strategy.num_nodes < 2:
        if hierarchical:
            rank_zero_info(f"{name}: hierarchical=True on one node: nothing to split, the push is flat")
        return None
    layout, hier = decide_hierarchy(strategy, name, hierarchical, "push")
    if not hier:
        return None
    if num_servers != layout.world:
        if hierarchical:
            raise ValueError(
                f"ParameterServerStrategy(num_servers={num_servers}, hierarchical=True) on {layout.world} "
                f"processes: expected num_servers={layout.world}, because local rank j of each node pushes to "
                "the shards hosted by local rank j of every node. Fix: pass num_servers=None, or "
                "hierarchical=False."
            )
        rank_zero_info(f"{name}: num_servers={num_servers} < {layout.world} processes: the push is flat")
        return None
    intra, inter = new_hierarchical_groups(layout, backend=backend, timeout=timeout)
    return PushNodes(layout, intra, inter)


def close_push_nodes(nodes: PushNodes | None, client: object, *, failed: bool) -> None:
    """Destroy the push's groups (and drop ``client``'s reference to its node group).

    After a failure too: destroying a gloo group closes its connections, so a node peer blocked in the node's
    collective with this rank fails at once instead of after ``timeout`` (NCCL groups are aborted instead:
    destroying one with pending work may block).
    """
    if isinstance(client, HierarchicalParameterServerClient):
        client.close()
    if nodes is None or not dist.is_initialized():
        return
    for group in (nodes.intra, nodes.inter):
        if failed and "nccl" in str(dist.get_backend(group)):
            group.abort()
        else:
            dist.destroy_process_group(group)


def check_align_pushes(strategy_class: type, align_pushes: object) -> None:
    """Raise for an ``align_pushes`` option the strategy cannot take (checked in the constructor)."""
    _check_node_option(
        strategy_class, "align_pushes", align_pushes,
        none_means="aligned where the flat push crosses nodes", supported="aligns_pushes",
        why_not="its workers push on their own schedules (no step that every worker takes together to align)",
        ps_push="synchronous push",
    )  # fmt: skip


def check_reply_per_bucket(strategy_class: type, reply_per_bucket: object, *, overlap: bool) -> None:
    """Raise for a ``reply_per_bucket`` option the strategy cannot take (checked in the constructor): the
    replies per bucket answer the overlapped push's buckets, so ``True`` needs ``overlap``."""
    _check_node_option(
        strategy_class, "reply_per_bucket", reply_per_bucket,
        none_means="per bucket where the flat push crosses nodes", supported="overlap_supported",
        why_not="its workers push and pull on their own schedules, not in buckets during backward",
        ps_push="synchronous, overlapped push",
    )  # fmt: skip
    if reply_per_bucket and not overlap:
        raise ValueError(
            f"{strategy_class.__name__}(reply_per_bucket=True, overlap=False): expected overlap=True, because the "
            "shards answer the buckets the overlapped push sends during backward. Fix: drop overlap=False, or "
            "pass reply_per_bucket=None."
        )


@dataclass
class PushAlignment:
    """A barrier of every worker before each step's first push (:attr:`ParameterServerClient.align
    <lightning_strategies.comm.ps.ParameterServerClient.align>`), on a gloo group: the default group where
    that is gloo, else one made for it (a host-side barrier: no device work and no stream sync per step).
    Bounded by the group's timeout; a lost peer's connections are shut down by the peer watch, which fails it
    at once."""

    group: dist.ProcessGroup | None  # None: the default group

    @property
    def owned(self) -> bool:
        """Whether the group was made for the alignment (and is destroyed with it)."""
        return self.group is not None

    def __call__(self) -> None:
        dist.barrier(group=self.group)


def plan_alignment(
    strategy: DDPStrategy, align_pushes: bool | None, *, flat: bool, backend: str | None, timeout: timedelta | None
) -> PushAlignment | None:
    """The alignment of this fit's pushes, or ``None``. ``align_pushes=None`` aligns where the push is flat and
    crosses nodes (measured: docs/measured/cluster.md); every rank decides alike, so a group made here is made
    by all."""
    if align_pushes is False or strategy.world_size < 2:
        return None
    if align_pushes is None and (not flat or strategy.num_nodes < 2):
        return None
    if backend == "gloo":
        return PushAlignment(None)
    group = new_group(backend="gloo", timeout=timeout)
    return PushAlignment(group)


def close_alignment(alignment: PushAlignment | None) -> None:
    """Destroy the group the alignment made (closing its connections: a peer blocked in it fails at once)."""
    if alignment is not None and alignment.group is not None and dist.is_initialized():
        dist.destroy_process_group(alignment.group)
