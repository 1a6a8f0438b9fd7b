"""The hierarchical push's sum inside the node: on gloo an all-reduce of the buffer (each rank keeping its
chunk), elsewhere a reduce-scatter. Both leave each local rank its chunk of the node's sum, checked against
the sum computed from every rank's buffer (the same seed on every rank), blocking and asynchronous. Two
processes on one node: a sum of two values does not depend on the order, so the chunks are bit-equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient
from lightning_strategies.comm.ring.layout import NodeLayout

pytestmark = pytest.mark.slow

WORLD = 2


def _buffer(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))


def _worker(rank: int, world: int) -> dict[str, Any]:
    params = [torch.zeros(7), torch.zeros(4)]
    layout = NodeLayout.from_ranks([0] * world, list(range(world)))
    client = HierarchicalParameterServerClient(rank, params, [[0], [1]], layout=layout, intra_group=dist.new_group())
    n = client.push_layout.chunk_numel
    expected = sum(_buffer(r, world * n) for r in range(world))[rank * n : (rank + 1) * n]
    out: dict[str, Any] = {"gloo_all_reduce": client.node_all_reduce}
    for all_reduce in (True, False):
        client.node_all_reduce = all_reduce
        chunk = torch.empty(n)
        client.reduce_in_node(_buffer(rank, world * n), chunk)
        buffer, later = _buffer(rank, world * n), torch.empty(n)
        client.reduce_in_node(buffer, later, async_op=True).wait()
        client.take_chunk(buffer, later)
        out[f"all_reduce={all_reduce}"] = [torch.equal(chunk, expected), torch.equal(later, expected)]
    return out


def test_the_node_sum_is_each_ranks_chunk_by_all_reduce_and_by_reduce_scatter() -> None:
    found = run_workers(_worker, WORLD, timeout=120.0)
    for rank, result in enumerate(found):
        assert result["gloo_all_reduce"], result  # gloo takes the all-reduce unless told otherwise
        assert result["all_reduce=True"] == [True, True], (rank, result)
        assert result["all_reduce=False"] == [True, True], (rank, result)
