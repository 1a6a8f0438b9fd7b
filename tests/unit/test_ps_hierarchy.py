"""The hierarchical push's geometry, byte formula, the shard's node pushers and the strategies' option checks, in
one process (no process group: ``test_ps_hierarchical_torchrun.py`` runs the push on 2 x 2 processes)."""

from __future__ import annotations

import itertools
import re
import time
from datetime import timedelta

import pytest
import torch

from lightning_strategies import AsyncParameterServerStrategy, ParameterServerStrategy
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterShard,
    PushLayout,
    Slice,
    node_nic_bytes,
    partition_parameters,
    plan_buckets,
    shard_parameters,
    whole_tensor_slices,
)
from lightning_strategies.comm.ps.hierarchy_overlap import _BucketLayout
from lightning_strategies.comm.ring import NodeLayout
from lightning_strategies.comm.rpc import ShardError

SIZES = [8 * 16, 16, 16 * 4, 4, 1000, 3]
LAYOUTS = {
    "contiguous": NodeLayout.contiguous(2, 3),
    "cyclic": NodeLayout.from_ranks([r % 2 for r in range(6)], [r // 2 for r in range(6)]),
}


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("whole", [False, True], ids=["elementwise", "whole_tensor"])
def test_chunks_hold_every_element_once_and_local_rank_j_pushes_local_rank_js_shards(
    layout_name: str, whole: bool
) -> None:
    layout = LAYOUTS[layout_name]
    plan = whole_tensor_slices(shard_parameters(SIZES, 6), SIZES) if whole else partition_parameters(SIZES, 6, align=8)
    pl = PushLayout(plan, layout)
    seen: dict[int, list[tuple[int, int]]] = {}
    for j, rows in enumerate(pl.entries):
        offsets = [off for _, _, off in rows]
        assert offsets == sorted(offsets)
        for s, sl, off in rows:
            # the shard of local rank j of some node, at its place in the chunk
            assert s in pl.chunk_shards[j] and layout.nodes[layout.node_of(s)].index(s) == j
            assert off + sl.numel <= pl.values_numel[j]
            seen.setdefault(sl.tensor, []).append((sl.start, sl.stop))
        # values, then one presence flag per slice, fit one chunk of the buffer
        assert pl.values_numel[j] + len(rows) <= pl.chunk_numel
    for i, n in enumerate(SIZES):
        covered = sorted(seen[i])
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # no gap, no overlap


def test_push_layout_needs_one_shard_per_process() -> None:
    with pytest.raises(ValueError, match=r"a plan of 3 shards for 6 processes.*num_servers=None"):
        PushLayout(partition_parameters(SIZES, 3), NodeLayout.contiguous(2, 3))
    with pytest.raises(ValueError, match="the same number on every node"):
        PushLayout(partition_parameters(SIZES, 3), NodeLayout(((0, 1), (2,))))


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 2), (3, 4)])
def test_node_nic_bytes_is_a_rings_with_even_shards_and_l_times_that_flat(nodes: int, local: int) -> None:
    layout = NodeLayout.contiguous(nodes, local)
    world = nodes * local
    shard_bytes = [1000] * world  # B = 1000 P, even
    total = sum(shard_bytes)
    hier = node_nic_bytes(shard_bytes, layout, hierarchical=True)
    flat = node_nic_bytes(shard_bytes, layout, hierarchical=False)
    assert hier == [2 * total * (nodes - 1) // nodes] * nodes
    assert flat == [local * h for h in hier]
    # uneven: node 0 hosts more; it pushes less and answers more
    uneven = [3000] * local + [1000] * (world - local)
    b, b0 = sum(uneven), 3000 * local
    assert node_nic_bytes(uneven, layout, hierarchical=True)[0] == (b - b0) + (nodes - 1) * b0


def _shard(num_workers: int, **kwargs: object) -> ParameterShard:
    params = [torch.zeros(3)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=1.0))
    return ParameterShard(0, [Slice(0, 0, 3)], params, spec, num_workers, **kwargs)  # type: ignore[arg-type]


def test_a_shard_of_node_pushers_sums_without_dividing_again() -> None:
    shard = _shard(2, pusher_ranks=[0, 2], average=False)
    a = shard.push(0, 0, [torch.full((3,), 0.25)], [1.0])
    b = shard.push(1, 0, [torch.full((3,), 0.5)], [1.0])
    assert a.done() and b.done()
    (value,) = shard.unpack(a.wait().values)
    assert value is not None
    torch.testing.assert_close(value, torch.full((3,), -0.75), rtol=0, atol=0)  # lr 1: minus the sum
    averaging = _shard(2)
    averaging.push(0, 0, [torch.full((3,), 0.25)], [1.0])
    (value,) = averaging.unpack(averaging.push(1, 0, [torch.full((3,), 0.5)], [1.0]).wait().values)
    assert value is not None
    torch.testing.assert_close(value, torch.full((3,), -0.375), rtol=0, atol=0)


def test_a_shard_of_node_pushers_names_the_missing_rank() -> None:
    shard = _shard(2, pusher_ranks=[1, 3], average=False, timeout=timedelta(seconds=0.3))
    fut = shard.push(0, 0, [torch.ones(3)], [1.0])
    deadline = time.monotonic() + 10
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    error = fut.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert re.search(r"from worker\(s\) \[3\] \(received from \[1\]\)", error.message)
    with pytest.raises(ValueError, match="1 pusher ranks for 2 pushers"):
        _shard(2, pusher_ranks=[1])


def test_hierarchical_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"hierarchical='yes'.*None .*True or False"):
        ParameterServerStrategy(hierarchical="yes")  # type: ignore[arg-type]
    for value in (None, True, False):
        assert ParameterServerStrategy(hierarchical=value).is_hierarchical is False  # decided at setup


def test_async_takes_the_hierarchical_option() -> None:
    # the node is the asynchronous worker on several nodes (tests/unit/test_async_hierarchy.py; 2 x 2 under
    # torchrun: tests/integration/test_async_hierarchical_torchrun.py)
    assert AsyncParameterServerStrategy(hierarchical=True).hierarchical_push is True
    assert AsyncParameterServerStrategy(hierarchical=None).is_hierarchical is False  # decided at setup


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("whole", [False, True], ids=["elementwise", "whole_tensor"])
def test_bucket_layouts_hold_every_slice_once_at_its_index_in_its_shards_plan(layout_name: str, whole: bool) -> None:
    layout = LAYOUTS[layout_name]
    plan = whole_tensor_slices(shard_parameters(SIZES, 6), SIZES) if whole else partition_parameters(SIZES, 6, align=8)
    pl = PushLayout(plan, layout)
    buckets = plan_buckets([4 * n for n in SIZES], plan, cap_bytes=64, first_cap_bytes=64)
    assert len(buckets) > 2
    seen: list[tuple[int, int]] = []
    for bucket in buckets:
        lay = _BucketLayout(bucket.tensors, pl.entries)
        for j, rows in enumerate(lay.rows):
            ends = [off + sl.numel for _, _, sl, off in rows]
            assert [off for _, _, _, off in rows] == [0, *ends][: len(rows)]  # packed, in chunk order
            assert lay.values_numel[j] + len(rows) <= lay.chunk_numel
            for s, k, sl, _ in rows:
                # the k-th slice of shard s, which local rank j pushes, of one of this bucket's tensors
                assert plan[s][k] == sl and sl.tensor in bucket.tensors and s in pl.chunk_shards[j]
                seen.append((s, k))
        # the shard's part of the bucket is what its rows name
        for s, ks in bucket.parts.items():
            assert sorted(k for rows in lay.rows for t, k, _, _ in rows if t == s) == list(ks)
    assert sorted(seen) == [(s, k) for s in range(len(plan)) for k in range(len(plan[s]))]
