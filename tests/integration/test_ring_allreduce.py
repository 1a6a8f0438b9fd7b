"""``ring_all_reduce`` against ``dist.all_reduce`` on 2-4 gloo processes.

Each world size starts its processes once; the worker loops over every case and returns
what it found, so the parent asserts with readable messages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import lightning_strategies.comm.ring.transport as ring_module
from lightning_strategies.comm import ring_all_reduce

pytestmark = pytest.mark.slow

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def _sizes(world: int) -> list[int]:
    return sorted({1, world - 1, 7, 1001, 2**20 + 3})


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + numel)
    if dtype in (torch.float32, torch.float64):
        return torch.randn(numel, generator=g, dtype=dtype)
    # Small integers: sums are exact in bfloat16 and int64, whatever the summation order,
    # so those dtypes are compared bit for bit.
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)


def _reference(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref)  # gloo has no AVG: sum, then divide as ring_all_reduce documents
    if op == "avg":
        ref = ref / world if ref.is_floating_point() else torch.div(ref, world, rounding_mode="trunc")
    return ref


def _same_on_every_rank(t: torch.Tensor) -> bool:
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return torch.equal(hi, lo)


def _compare_worker(rank: int, world: int, wire: torch.dtype | None, batched: bool) -> list[dict[str, Any]]:
    if batched:  # exercise the NCCL code path (one batch_isend_irecv per step) on gloo
        ring_module._ring_pipelined = lambda ring, seg_elems: ring_module._ring_batched(ring)  # type: ignore[assignment]
    rows = []
    dtypes = DTYPES if wire is None else (torch.float32, torch.float64)
    for numel in _sizes(world):
        for dtype in dtypes:
            for op in ("sum", "avg"):
                x = _input(rank, numel, dtype)
                ref = _reference(x, op, world)
                # Small segments on small tensors too, so the pipelined path runs many segments.
                stats = ring_all_reduce(x, op=op, wire_dtype=wire, segment_bytes=4096 if numel < 2**20 else 2**20)
                sent = torch.tensor([stats.bytes_sent, stats.bytes_received], dtype=torch.int64)
                dist.all_reduce(sent)
                rows.append(
                    {
                        "case": f"P={world} numel={numel} {dtype} {op} wire={wire}",
                        "max_err": float((x.double() - ref.double()).abs().max()),
                        "scale": float(ref.double().abs().max()) + 1.0,
                        "identical_on_ranks": _same_on_every_rank(x),
                        "bytes_sent": stats.bytes_sent,
                        "bytes_received": stats.bytes_received,
                        "total_sent": int(sent[0]),
                        "total_received": int(sent[1]),
                        "itemsize": (wire or dtype).itemsize,
                        "numel": numel,
                        "dtype": dtype,
                    }
                )
    return rows


def _check_bytes(row: dict[str, Any], world: int) -> None:
    # Per rank: 2(P-1)/P x numel x itemsize, off by at most two elements because chunks differ
    # in size by one element instead of being padded; over all ranks: exact.
    formula = 2 * (world - 1) / world * row["numel"] * row["itemsize"]
    assert abs(row["bytes_sent"] - formula) <= 2 * row["itemsize"], row
    assert abs(row["bytes_received"] - formula) <= 2 * row["itemsize"], row
    assert row["total_sent"] == row["total_received"] == 2 * (world - 1) * row["numel"] * row["itemsize"], row


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_equals_all_reduce(world: int) -> None:
    rows = run_workers(_compare_worker, world, None, False, timeout=150)[0]
    assert len(rows) == len(_sizes(world)) * len(DTYPES) * 2
    for row in rows:
        # float32/float64: the ring adds in another order than gloo's ring, so the results differ
        # by a few ulps of the largest partial sum (P-1 additions); 1e-6 / 1e-14 of the value
        # scale is ~8 / ~45 ulps. bfloat16 / int64 inputs are small integers: exact.
        tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(row["dtype"], 0.0)
        assert row["max_err"] <= tol * row["scale"], row
        assert row["identical_on_ranks"], row
        _check_bytes(row, world)


# P = 4: two all-gather steps forward segments straight from the wire-dtype shadow they land in.
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bf16_wire_is_within_bf16_rounding_and_identical_on_every_rank(world: int) -> None:
    rows = run_workers(_compare_worker, world, torch.bfloat16, False, timeout=150)[0]
    for row in rows:
        # Each of the P-1 partial sums and the final value is rounded once to bfloat16
        # (relative error 2^-9 each): at most P x 2^-9 of the largest partial sum.
        assert row["max_err"] <= world * 2**-9 * row["scale"], row
        # The owner rounds its own copy too, so DDP replicas stay bit-identical.
        assert row["identical_on_ranks"], row
        _check_bytes(row, world)


def test_batched_path_used_on_nccl_equals_all_reduce() -> None:
    for wire in (None, torch.float16):
        for row in run_workers(_compare_worker, 3, wire, True, timeout=150)[0]:
            tol = {torch.float32: 1e-6, torch.float64: 1e-14}.get(row["dtype"], 0.0)
            if wire is not None:
                tol = 3 * 2**-11
            assert row["max_err"] <= tol * row["scale"], row
            assert row["identical_on_ranks"], row
            _check_bytes(row, 3)


def _mismatch_worker(rank: int, world: int, kind: str) -> str:
    x = torch.zeros(10 + (rank if kind == "size" else 0))
    if kind == "dtype" and rank == 1:
        x = x.double()
    if kind == "bad_input" and rank == 1:
        x = torch.zeros(5, 2).t()  # non-contiguous on one rank only
    try:
        ring_all_reduce(x)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    ("kind", "others", "culprit"),
    [
        ("size", "ranks disagree on the call (rank 0: numel=10", "ranks disagree"),
        ("dtype", "rank 1: numel=10 dtype=float64", "ranks disagree"),
        ("bad_input", "rank(s) [1] rejected their input", "not contiguous"),
    ],
)
def test_mismatched_calls_raise_on_every_rank_instead_of_hanging(kind: str, others: str, culprit: str) -> None:
    errors = run_workers(_mismatch_worker, 3, kind, timeout=60, pg_timeout_s=20)
    assert errors[1].startswith("ValueError") and culprit in errors[1], errors
    for rank in (0, 2):
        assert errors[rank].startswith("ValueError") and others in errors[rank], errors
