"""Fast single-process checks of the ring's input validation and of the ``"ring"`` strategy's
construction (no worker processes: a world-size-1 gloo group over an in-memory store)."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

import lightning_strategies  # noqa: F401  (registers "ring")
from lightning_strategies.comm import CommStats, RingBucketReducer, ring_all_reduce
from lightning_strategies.comm.ring import resolve_wire_dtype
from lightning_strategies.comm.ring.transport import _chunk_bounds
from lightning_strategies.strategies.ring import RingAllReduceStrategy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_world_of_one_is_a_no_op_with_zero_bytes(world_of_one: None, dtype: torch.dtype, op: str) -> None:
    x = torch.arange(10).to(dtype)
    before = x.clone()
    stats = ring_all_reduce(x, op=op, wire_dtype=torch.bfloat16 if dtype == torch.float32 else None)
    assert torch.equal(x, before)
    assert (stats.bytes_sent, stats.bytes_received, stats.calls) == (0, 0, 1)


def test_non_contiguous_input_is_refused(world_of_one: None) -> None:
    x = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match=r"not contiguous.*tensor\.contiguous\(\)"):
        ring_all_reduce(x)


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_unsupported_dtype_is_refused_listing_the_supported_ones(world_of_one: None, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=r"unsupported dtype .*supported: float16, bfloat16, float32"):
        ring_all_reduce(torch.zeros(3, dtype=dtype))


def test_bad_op_is_refused(world_of_one: None) -> None:
    with pytest.raises(ValueError, match=r"invalid op 'mean'.*\['sum', 'avg'\]"):
        ring_all_reduce(torch.zeros(3), op="mean")


@pytest.mark.parametrize("wire", ["int8", torch.float64, 16])
def test_bad_wire_dtype_is_refused_listing_the_valid_ones(world_of_one: None, wire: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid wire_dtype .*'bf16'.*'fp16'"):
        ring_all_reduce(torch.zeros(3), wire_dtype=wire)  # type: ignore[arg-type]


def test_wire_dtype_needs_a_wider_floating_tensor(world_of_one: None) -> None:
    with pytest.raises(ValueError, match="needs a floating tensor"):
        ring_all_reduce(torch.zeros(3, dtype=torch.int32), wire_dtype="bf16")
    with pytest.raises(ValueError, match="not narrower"):
        ring_all_reduce(torch.zeros(3, dtype=torch.float16), wire_dtype="bf16")


def test_not_a_tensor_is_refused(world_of_one: None) -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, found list"):
        ring_all_reduce([1.0, 2.0])  # type: ignore[arg-type]


def test_without_a_process_group_the_error_says_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_all_reduce(torch.zeros(3))


@pytest.mark.parametrize(("numel", "parts"), [(0, 3), (1, 4), (3, 4), (7, 3), (1001, 4), (2**20 + 3, 3)])
def test_chunks_cover_the_tensor_without_padding(numel: int, parts: int) -> None:
    bounds = _chunk_bounds(numel, parts)
    sizes = [e - s for s, e in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert max(sizes) - min(sizes) <= 1


def test_resolve_wire_dtype_names() -> None:
    assert resolve_wire_dtype(None) is None
    assert resolve_wire_dtype("bf16") is torch.bfloat16
    assert resolve_wire_dtype("FP16") is torch.float16
    assert resolve_wire_dtype(torch.bfloat16) is torch.bfloat16


def test_bucket_reducer_completes_futures_in_order_and_counts(world_of_one: None) -> None:
    reducer = RingBucketReducer(dist.new_group())
    try:
        tensors = [torch.full((5,), float(i)) for i in range(3)]
        futures = [reducer.submit(t) for t in tensors]
        values = [f.wait() for f in futures]
        assert all(v is t for v, t in zip(values, tensors, strict=True))
        stats = reducer.pop_stats()
        assert stats == CommStats(calls=3, seconds=stats.seconds)
        assert reducer.pop_stats().calls == 0
    finally:
        reducer.close()
    with pytest.raises(RuntimeError, match="closed"):
        reducer.submit(torch.zeros(1))


def test_dropped_reducer_stops_its_thread(world_of_one: None) -> None:
    """A reducer never closed (its strategy never torn down) leaves no thread running."""
    reducer = RingBucketReducer(dist.new_group())
    thread = reducer._thread
    assert reducer.submit(torch.ones(3)).wait().sum() == 3
    del reducer
    gc.collect()  # DDP's hook closes a cycle through the strategy; the collector breaks it
    thread.join(5.0)
    assert not thread.is_alive()


_EXIT_SCRIPT = """
import atexit, threading
# registered first, so it runs last: after every finalizer the reducer registered
atexit.register(lambda: print("alive at exit:", sorted(t.name for t in threading.enumerate())))
import torch, torch.distributed as dist
from lightning_strategies.comm.ring import RingBucketReducer
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
reducer = RingBucketReducer(dist.new_group())  # never closed
assert reducer.submit(torch.ones(3)).wait().sum() == 3
print("reduced")
"""


def test_reducer_alive_at_exit_is_closed_before_the_interpreter_tears_down() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120, env=_one_thread_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reduced" in done.stdout
    alive = [line for line in done.stdout.splitlines() if line.startswith("alive at exit:")]
    assert alive and "ring-all-reduce" not in alive[0], done.stdout


def _one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


def test_strategy_resolves_by_name() -> None:
    trainer = Trainer(strategy="ring", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is RingAllReduceStrategy
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.wire_dtype is None
    trainer = Trainer(strategy="ring_bf16", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is RingAllReduceStrategy
    assert trainer.strategy.wire_dtype == "bf16"


def test_strategy_passes_ddp_options_through() -> None:
    strategy = RingAllReduceStrategy(bucket_cap_mb=4, find_unused_parameters=True, start_method="fork")
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 4, "find_unused_parameters": True}
    assert strategy._start_method == "fork"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wire_dtype": "int8"}, r"Invalid wire_dtype 'int8'.*'bf16'.*'fp16'"),
        ({"wire_dtype": torch.bfloat16}, r"Invalid wire_dtype .*'bf16'"),
        ({"bucket_cap_mb": 0}, "positive number of MiB"),
        ({"ddp_comm_hook": lambda state, bucket: None}, r"\['ddp_comm_hook'\].*the ring is itself"),
    ],
)
def test_strategy_rejects_bad_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RingAllReduceStrategy(**kwargs)  # type: ignore[arg-type]
