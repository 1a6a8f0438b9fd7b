"""``benchmarks/cluster_strategies.py``'s formulas: bytes through the busiest node's link per step, in D.

The quick run in CI measures ps alone on the emulated cluster; these hold every strategy's formula to
the arithmetic written out per layout, and ps's (hierarchical and flat push) to the library's own
count of what a node's NIC carries (``node_nic_bytes``, even shards).
"""

from __future__ import annotations

import pytest

from benchmarks.cluster_strategies import LAYOUTS, STRATEGIES, formula_over_d
from lightning_strategies.comm.ps.hierarchy import node_nic_bytes
from lightning_strategies.comm.ring.layout import NodeLayout

# P = 4 processes; 2x2: N = 2 nodes of L = 2, 4x1: N = 4 nodes of L = 1
EXPECTED = {
    "2x2": {
        "ddp": 2 * 3 / 4, "ring": 2 * 3 / 4, "ring_bf16": 3 / 4,  # 2(P-1)/P, bf16 half of it
        "ring_hier": 2 * 1 / 2, "ps": 2 * 1 / 2, "ps_one_shot": 2 * 1 / 2,  # 2(N-1)/N (one-shot: the same bytes)
        "ps_local_sigterm": 2 * 1 / 2,  # ps with each rank checking its own SIGTERM: the same bytes
        "ps_aligned": 2 * 1 / 2, "ps_unaligned": 2 * 1 / 2,  # ps with its pushes aligned or not: the same bytes
        "ps_one_reply": 2 * 1 / 2, "ps_bucket_replies": 2 * 1 / 2,  # one reply per shard, or per bucket: the same
        "ps_bucket_plan": 2 * 1 / 2,  # the plan per bucket, one reply per shard: the same bytes
        "async": 2 * 1 / 2,  # the node as the worker: ps's 2(N-1)/N
        "ps_flat": 2 * 2 * 2 / 4, "async_flat": 2 * 2 * 2 / 4,  # 2L(P-L)/P
        "ps1": 2.0, "ps1_one_reply": 2.0,  # P - L remote workers' gradients in, parameters out
        "ps_ring": 2 * 1 / 2, "ps_ring_flat": 2 * 3 / 4,  # the hierarchical ring's halves; the flat ring's
        "pipeline": None, "tensor": None,  # activations, not gradients
    },
    "4x1": {
        "ddp": 1.5, "ring": 1.5, "ring_bf16": 0.75, "ring_hier": 1.5, "ps": 1.5, "ps_one_shot": 1.5, "ps_flat": 1.5,
        "ps_local_sigterm": 1.5, "ps_aligned": 1.5, "ps_unaligned": 1.5, "ps_one_reply": 1.5,
        "ps_bucket_replies": 1.5, "ps_bucket_plan": 1.5,
        "async": 1.5, "async_flat": 1.5,
        "ps1": 3.0, "ps1_one_reply": 3.0, "ps_ring": 1.5, "ps_ring_flat": 1.5, "pipeline": None, "tensor": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_strategys_formula_per_layout(layout: str) -> None:
    nodes, per_node = LAYOUTS[layout]
    assert set(EXPECTED[layout]) == set(STRATEGIES)
    for strategy in STRATEGIES:
        assert formula_over_d(strategy, nodes, per_node) == pytest.approx(EXPECTED[layout][strategy]), strategy


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("strategy", "hierarchical"), [("ps", True), ("ps_flat", False), ("async", True), ("async_flat", False)]
)
def test_ps_formulas_are_the_librarys_node_bytes(layout: str, strategy: str, hierarchical: bool) -> None:
    nodes, per_node = LAYOUTS[layout]
    shard = 1000  # one even shard per process: D = 4 shards
    ranks = range(nodes * per_node)
    node_layout = NodeLayout.from_ranks([r // per_node for r in ranks], [r % per_node for r in ranks])
    busiest = max(node_nic_bytes([shard] * len(ranks), node_layout, hierarchical=hierarchical))
    # on 4x1 the hierarchical push is the flat one (one process per node)
    assert formula_over_d(strategy, nodes, per_node) == pytest.approx(busiest / (shard * len(ranks)))
