"""The hierarchical ring's node layout, the bucket rule for large rings, the node split of
``CommStats`` and the strategy's new options, without worker processes."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

import lightning_strategies  # noqa: F401  (registers "ring_hier")
from lightning_strategies.comm.ring import MIN_CHUNK_BYTES, NodeLayout, ring_bucket_cap_mb
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.strategies.ring import RingAllReduceStrategy

MIB = 1 << 20


def test_contiguous_layout_groups() -> None:
    layout = NodeLayout.contiguous(3, 2)
    assert layout.nodes == ((0, 1), (2, 3), (4, 5))
    assert (layout.num_nodes, layout.local_size, layout.world) == (3, 2, 6)
    assert layout.intra_node_ranks() == [[0, 1], [2, 3], [4, 5]]
    # local rank i of every node, in node order: the ring across nodes of each local rank
    assert layout.inter_node_ranks() == [[0, 2, 4], [1, 3, 5]]
    assert [layout.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]


def test_layout_from_the_launchers_ranks_need_not_be_contiguous() -> None:
    # SLURM --distribution=cyclic: rank r on node r % 2, the r // 2-th task there
    layout = NodeLayout.from_ranks([0, 1, 0, 1, 0, 1], [0, 0, 1, 1, 2, 2])
    assert layout.nodes == ((0, 2, 4), (1, 3, 5))
    assert layout.inter_node_ranks() == [[0, 1], [2, 3], [4, 5]]
    assert layout == NodeLayout.from_ranks(*zip(*[(r % 2, r // 2) for r in range(6)], strict=True))


def test_uneven_nodes_are_a_layout_but_not_a_hierarchical_one() -> None:
    layout = NodeLayout.from_ranks([0, 0, 0, 1], [0, 1, 2, 0])
    assert layout.nodes == ((0, 1, 2), (3,)) and not layout.uniform and layout.node_of(3) == 1
    with pytest.raises(ValueError, match=r"found \[3, 1\] processes on nodes 0..1: expected the same number.*"
                                         r"Fix: .*--nproc-per-node.*hierarchical=False"):  # fmt: skip
        _ = layout.local_size
    with pytest.raises(ValueError, match="expected the same number"):
        layout.inter_node_ranks()


@pytest.mark.parametrize(
    ("nodes", "locals_", "match"),
    [
        ([0, 0], [0, 0], r"ranks 0 and 1 both claim local rank 0 on node 0"),
        ([0, 0], [0, 2], r"node 0 has local ranks \[0, 2\]: expected 0..1"),
        ([0, 2], [0, 0], r"found node ranks \[0, 2\], no process on node\(s\) \[1\]: expected node ranks 0..2"),
        ([0, -1], [0, 0], r"rank 1 has node rank -1"),
        ([0, 1], [0], r"found 2 node ranks and 1 local ranks"),
    ],
)
def test_inconsistent_ranks_are_refused_saying_what_to_check(nodes: list[int], locals_: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NodeLayout.from_ranks(nodes, locals_)


def test_bucket_rule_grows_buckets_only_where_chunks_get_small() -> None:
    # the default: 256 KiB per chunk, so a 25 MiB bucket keeps its size up to P = 100
    assert MIN_CHUNK_BYTES == 256 << 10
    assert ring_bucket_cap_mb(25.0, 100) == 25.0
    assert ring_bucket_cap_mb(25.0, 101) == 101 * 0.25
    assert ring_bucket_cap_mb(25.0, 256) == 64.0  # 256 chunks of 256 KiB
    for world in (2, 8, 64, 256, 1024):
        cap = ring_bucket_cap_mb(25.0, world, MIB)
        assert cap == max(25.0, world * 1.0)
        assert cap * MIB / world >= MIB  # the rule's promise: every chunk >= min_chunk_bytes
    assert ring_bucket_cap_mb(25.0, 1024, 0) == 25.0  # off
    with pytest.raises(ValueError, match="expected world >= 1 and min_chunk_bytes >= 0"):
        ring_bucket_cap_mb(25.0, 4, -1)


def test_commstats_node_split_adds_and_logs_only_when_counted() -> None:
    plain = CommStats(bytes_sent=10, bytes_received=10, calls=1, seconds=0.5)
    assert plain.inter_node_bytes_sent is None and plain.intra_node_bytes_sent is None
    assert set(plain.as_dict()) == {"comm/bytes_sent", "comm/bytes_received", "comm/calls", "comm/seconds"}
    split = CommStats(100, 80, calls=1, inter_node_bytes_sent=30, inter_node_bytes_received=20)
    both = plain + split
    assert (both.bytes_sent, both.inter_node_bytes_sent, both.intra_node_bytes_sent) == (110, 30, 80)
    assert (both.bytes_received, both.inter_node_bytes_received, both.intra_node_bytes_received) == (90, 20, 70)
    assert both.as_dict("x/") == {
        "x/bytes_sent": 110.0, "x/bytes_received": 90.0, "x/calls": 2.0, "x/seconds": 0.5,
        "x/inter_node_bytes_sent": 30.0, "x/inter_node_bytes_received": 20.0,
        "x/intra_node_bytes_sent": 80.0, "x/intra_node_bytes_received": 70.0,
    }  # fmt: skip
    before = both.reset()
    assert before.inter_node_bytes_sent == 30
    assert both == CommStats(inter_node_bytes_sent=0, inter_node_bytes_received=0)  # zeroed, still split
    assert plain.reset() == CommStats(10, 10, 1, 0.5) and plain == CommStats()  # unsplit stays unsplit


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hierarchical": "yes"}, r"Invalid hierarchical='yes': expected None .*True or False"),
        ({"hierarchical": 1}, r"Invalid hierarchical=1"),
        ({"min_chunk_bytes": -1}, r"Invalid min_chunk_bytes=-1: expected an integer number of bytes >= 0"),
        ({"min_chunk_bytes": 1.5}, r"Invalid min_chunk_bytes=1.5"),
    ],
)
def test_strategy_refuses_bad_hierarchy_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RingAllReduceStrategy(**kwargs)  # type: ignore[arg-type]


def test_ring_hier_is_a_registry_row() -> None:
    trainer = Trainer(strategy="ring_hier", accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, RingAllReduceStrategy) and strategy.hierarchical is True
    assert not strategy.is_hierarchical and strategy.node_layout is None  # decided at setup
    assert RingAllReduceStrategy().hierarchical is None  # "ring": decided from the nodes
