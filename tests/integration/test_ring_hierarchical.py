"""``hierarchical_all_reduce`` against ``dist.all_reduce`` on 4 gloo processes laid out as 2 nodes x 2,
and its byte accounting split by node.

The "nodes" are a :class:`NodeLayout` over 4 forked processes of one machine: the algorithm
only sees its intra- and inter-node groups, so where the processes run does not matter to what it
computes (``test_ring_hierarchical_torchrun.py`` runs it under two torchrun "nodes", with the layout
taken from Lightning's cluster environment). Two layouts: contiguous (node n = ranks 2n, 2n+1,
as torchrun numbers them) and cyclic (node = rank % 2, SLURM's ``--distribution=cyclic``), so a
global/group rank mix-up shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import lightning_strategies.comm.ring.transport as ring_module
from lightning_strategies.comm.ring import (
    NodeLayout,
    hierarchical_all_reduce,
    new_hierarchical_groups,
    ring_all_reduce,
)

pytestmark = pytest.mark.slow

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
LAYOUTS = {
    "contiguous": NodeLayout.contiguous(NODES, LOCAL),
    "cyclic": NodeLayout.from_ranks([r % NODES for r in range(WORLD)], [r // NODES for r in range(WORLD)]),
}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
# numel below L (empty chunks), below P, odd, and large enough for many gloo segments
SIZES = (1, 3, 7, 1001, 2**18 + 3)


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + numel)
    if dtype in (torch.float32, torch.float64):
        return torch.randn(numel, generator=g, dtype=dtype)
    # Small integers: sums are exact in bfloat16 and int64 whatever the order: compared bit for bit.
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return torch.equal(hi, lo)


def _total(*values: int) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t)
    return [int(v) for v in t]


def _compare_worker(rank: int, world: int, layout_name: str, wire: torch.dtype | None, batched: bool) -> list[dict]:
    if batched:  # exercise the NCCL code path (one batch_isend_irecv per step) on gloo
        ring_module._ring_pipelined = lambda ring, seg_elems: ring_module._ring_batched(ring)  # type: ignore[assignment]
    layout = LAYOUTS[layout_name]
    intra, inter = new_hierarchical_groups(layout, backend="gloo")
    rows = []
    dtypes = DTYPES if wire is None else (torch.float32, torch.float64)
    for numel in SIZES:
        for dtype in dtypes:
            for op in ("sum", "avg"):
                x = _input(rank, numel, dtype)
                ref = x.clone()
                dist.all_reduce(ref)  # gloo has no AVG: sum, then divide as the ring documents
                if op == "avg":
                    ref = ref / world if ref.is_floating_point() else torch.div(ref, world, rounding_mode="trunc")
                stats = hierarchical_all_reduce(x, intra, inter, op=op, wire_dtype=wire, segment_bytes=4096)
                assert stats.inter_node_bytes_sent is not None and stats.inter_node_bytes_received is not None
                totals = _total(stats.bytes_sent, stats.bytes_received, stats.inter_node_bytes_sent,
                                stats.inter_node_bytes_received)  # fmt: skip
                rows.append({
                    "case": f"{layout_name} numel={numel} {dtype} {op} wire={wire} batched={batched}",
                    "max_err": float((x.double() - ref.double()).abs().max()),
                    "scale": float(ref.double().abs().max()) + 1.0,
                    "identical_on_ranks": _same_on_every_rank(x),
                    "inter_sent": stats.inter_node_bytes_sent,
                    "inter_received": stats.inter_node_bytes_received,
                    "intra_sent": stats.intra_node_bytes_sent,
                    "totals": totals,
                    "itemsize": (wire or dtype).itemsize,
                    "numel": numel,
                    "dtype": dtype,
                })  # fmt: skip
    return rows


def _check_bytes(row: dict[str, Any]) -> None:
    n, size = row["numel"], row["itemsize"]
    # Per process: 2(N-1)/N of its node's L-th of the tensor to other nodes, 2(L-1)/L of the tensor
    # inside the node. Off by the uneven chunking: a chunk of numel/L differs from it by < 1 element
    # and the inter ring's own chunks by one more, two steps each way: 3 elements bound both.
    inter = 2 * (NODES - 1) / NODES * n / LOCAL * size
    intra = 2 * (LOCAL - 1) / LOCAL * n * size
    assert abs(row["inter_sent"] - inter) <= 3 * size, row
    assert abs(row["inter_received"] - inter) <= 3 * size, row
    assert abs(row["intra_sent"] - intra) <= 3 * size, row
    # Over all processes, exact: each of the L inter-node rings sends 2(N-1) times its chunk, the
    # chunks make up the tensor; each of the N nodes' two intra rings sends (L-1) x the tensor.
    total_inter = 2 * (NODES - 1) * n * size
    total = total_inter + NODES * 2 * (LOCAL - 1) * n * size
    assert row["totals"] == [total, total, total_inter, total_inter], row


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_hierarchical_ring_equals_all_reduce(layout_name: str) -> None:
    rows = run_workers(_compare_worker, WORLD, layout_name, None, False, timeout=150)
    for rank_rows in rows:
        assert len(rank_rows) == len(SIZES) * len(DTYPES) * 2
        for row in rank_rows:
            # float32/float64: another summation order than gloo's, a few ulps of the largest partial
            # sum (as the flat ring's test); bfloat16 / int64 inputs are small integers: exact.
            tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(row["dtype"], 0.0)
            assert row["max_err"] <= tol * row["scale"], row
            assert row["identical_on_ranks"], row
            _check_bytes(row)


@pytest.mark.parametrize("batched", [False, True], ids=["gloo_path", "nccl_path"])
def test_hierarchical_bf16_wire_is_within_bf16_rounding_and_identical(batched: bool) -> None:
    for row in run_workers(_compare_worker, WORLD, "contiguous", torch.bfloat16, batched, timeout=150)[0]:
        # Rounded to bfloat16 (2^-9 relative) at most once per intra hop (L-1), once when the
        # node's sum enters the inter-node ring, once per inter hop (N-1) and once at the end:
        # L + N roundings of values no larger than the largest partial sum.
        assert row["max_err"] <= (LOCAL + NODES) * 2**-9 * row["scale"], row
        assert row["identical_on_ranks"], row  # DDP replicas must not drift apart
        _check_bytes(row)


def _flat_worker(rank: int, world: int, layout_name: str) -> dict[str, int | None]:
    stats = ring_all_reduce(torch.ones(1000), layout=LAYOUTS[layout_name])
    return {"inter": stats.inter_node_bytes_sent, "inter_received": stats.inter_node_bytes_received,
            "all": stats.bytes_sent}  # fmt: skip


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_flat_ring_splits_its_bytes_by_node(layout_name: str) -> None:
    layout = LAYOUTS[layout_name]
    found = run_workers(_flat_worker, WORLD, layout_name, timeout=60)
    per_rank = 2 * (WORLD - 1) / WORLD * 1000 * 4  # 1000 elements in 4 chunks of 250: exact
    for rank, row in enumerate(found):
        assert row["all"] == per_rank, found
        # a rank's whole traffic crosses nodes exactly when its successor (predecessor) is elsewhere
        crosses_out = layout.node_of((rank + 1) % WORLD) != layout.node_of(rank)
        crosses_in = layout.node_of((rank - 1) % WORLD) != layout.node_of(rank)
        assert row["inter"] == (per_rank if crosses_out else 0), found
        assert row["inter_received"] == (per_rank if crosses_in else 0), found


def _mismatch_worker(rank: int, world: int, bad_rank: int) -> str:
    intra, inter = new_hierarchical_groups(LAYOUTS["contiguous"], backend="gloo")
    x = torch.zeros(5, 2).t() if rank == bad_rank else torch.zeros(10)  # non-contiguous on one rank
    try:
        hierarchical_all_reduce(x, intra, inter)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_bad_call_on_one_process_raises_on_every_process() -> None:
    errors = run_workers(_mismatch_worker, WORLD, 3, timeout=60, pg_timeout_s=20)
    assert errors[3].startswith("ValueError") and "not contiguous" in errors[3], errors
    assert "rank(s) [3] rejected their input" in errors[2], errors  # its node-mate, in the first stage
    for rank in (0, 1):  # the other node learns it in the second stage, from local rank 1's (rank 3's) verdict
        assert errors[rank].startswith("ValueError") and "rejected their input" in errors[rank], errors
