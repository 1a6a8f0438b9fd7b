"""Which ranks share a node, read from Lightning's cluster environment: shared by the hierarchical ring and
the hierarchical parameter-server push, so both split a job into nodes the same way."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_strategies.comm.groups import new_group
from lightning_strategies.comm.ring.layout import NodeLayout, new_hierarchical_groups

__all__ = ["decide_hierarchy", "gather_node_layout", "ring_groups", "wants_hierarchy"]


def gather_node_layout(strategy: DDPStrategy, name: str) -> NodeLayout:
    """Every rank's (node rank, local rank), all-gathered once: a collective of the default group.

    Args:
        name: the strategy's name, for the error.

    Raises:
        ValueError: the node ranks disagree with ``Trainer(num_nodes=...)``.
    """
    mine = torch.tensor([strategy.node_rank, strategy.local_rank], dtype=torch.int64, device=strategy.root_device)
    rows = [torch.empty_like(mine) for _ in range(strategy.world_size)]
    dist.all_gather(rows, mine)  # once per fit: the only host read of this setup
    node_ranks, local_ranks = torch.stack(rows).T.tolist()
    layout = NodeLayout.from_ranks(node_ranks, local_ranks)
    if layout.num_nodes != strategy.num_nodes:
        raise ValueError(
            f"{name}: found node ranks 0..{layout.num_nodes - 1} in the cluster environment "
            f"({type(strategy.cluster_environment).__name__}): expected Trainer(num_nodes={strategy.num_nodes}). "
            "Fix: make num_nodes the number of nodes the launcher started (torchrun --nnodes, SLURM --nodes)."
        )
    return layout


def wants_hierarchy(hierarchical: bool | None, layout: NodeLayout) -> bool:
    """Whether to go hierarchical: ``hierarchical`` is not ``False`` and there is more than one node of more
    than one process (else nothing is left to split).

    Raises:
        ValueError: more than one node of different sizes under ``hierarchical`` not ``False``.
    """
    wanted = hierarchical is not False and layout.num_nodes > 1
    if wanted:
        layout.require_uniform()  # the same number of processes on every node, or a clear error
    return wanted and layout.local_size > 1


def ring_groups(
    strategy: DDPStrategy, name: str, hierarchical: bool | None, *, backend: str, timeout: timedelta | None
) -> tuple[NodeLayout, list[dist.ProcessGroup]]:
    """The node layout and the ring's process groups of their own (a collective: every rank, in the same order):
    ``[intra, inter]`` where the ring goes hierarchical (:func:`wants_hierarchy`), else ``[the whole world]``;
    said on rank 0 when ``hierarchical=True`` finds nothing to split."""
    layout, hier = decide_hierarchy(strategy, name, hierarchical, "ring")
    if not hier:
        return layout, [new_group(timeout=timeout, backend=backend)]
    return layout, list(new_hierarchical_groups(layout, backend=backend, timeout=timeout))


def decide_hierarchy(
    strategy: DDPStrategy, name: str, hierarchical: bool | None, what: str
) -> tuple[NodeLayout, bool]:
    """The node layout (:func:`gather_node_layout`, a collective) and whether to go hierarchical
    (:func:`wants_hierarchy`); said on rank 0, as "the ``what`` is flat", when ``hierarchical=True`` finds nothing
    to split."""
    layout = gather_node_layout(strategy, name)
    hier = wants_hierarchy(hierarchical, layout)
    if hierarchical and not hier:
        rank_zero_info(
            f"{name}: hierarchical=True on {layout.num_nodes} node(s) of {len(layout.nodes[0])} process(es): "
            f"nothing to split, the {what} is flat"
        )
    return layout, hier
