"""comm.ring's two halves and :class:`RingShards` on 2 and 3 gloo processes, against the references: the halves
against ``dist.all_reduce``; the shards' step against the user's optimizer stepping the all-reduced average of
every rank's gradient on all of it (what DDP does), with clipping as ``torch.nn.utils.clip_grad_norm_`` and
``clamp_``; their gathered state against that optimizer's ``state_dict``; a lost peer named, in time."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import lightning_strategies.comm.ring.transport as ring_module
from lightning_strategies.comm.ps import OptimizerSpec, RingShards, gather_ring_state, load_ring_state
from lightning_strategies.comm.ps.clip import ClipSpec
from lightning_strategies.comm.ring import RingPeerError, owned_chunk, ring_all_gather, ring_reduce_scatter

pytestmark = pytest.mark.slow

SHAPES = [(5, 7), (7,), (3, 4, 2), (1,), (33, 3)]  # 106 elements, cut anywhere by the chunks


def _grad(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + len(shape))
    return torch.randn(shape, generator=g)


def test_owned_chunk_is_the_reduce_scatters_and_covers_the_tensor() -> None:
    for world in (1, 2, 3, 5):
        for numel in (0, 1, 4, 106):
            chunks = sorted(owned_chunk(numel, world, r) for r in range(world))
            assert chunks[0][0] == 0 and chunks[-1][1] == numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
            assert max(b - a for a, b in chunks) - min(b - a for a, b in chunks) <= 1
    with pytest.raises(ValueError, match="found rank 2 of a world of 2"):
        owned_chunk(10, 2, 2)


def _halves(rank: int, world: int) -> dict[str, Any]:
    pg = dist.group.WORLD
    assert pg is not None
    out: dict[str, Any] = {}
    for numel in (1, 7, 106, 2**20 + 3):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 7 + numel))
        ref = x.clone()
        dist.all_reduce(ref)
        ref /= world
        stats = ring_reduce_scatter(x, pg, average=True)
        a, b = owned_chunk(numel, world, rank)
        out[f"owned_{numel}"] = float((x[a:b] - ref[a:b]).abs().max()) if b > a else 0.0
        sent_rs = stats.bytes_sent
        ring_all_gather(x, pg, stats=stats)
        # every rank ends with every rank's owned chunk: the all-reduce (up to summation order)
        out[f"all_{numel}"] = float((x - ref).abs().max())
        out[f"bytes_{numel}"] = (sent_rs, stats.bytes_sent, stats.calls)
        same = x.clone()
        dist.broadcast(same, 0)
        out[f"same_{numel}"] = torch.equal(same, x)
    try:
        ring_all_gather(torch.zeros(4, 4).t(), pg)
    except ValueError as err:
        out["noncontiguous"] = str(err)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_halves_are_the_all_reduce(world: int) -> None:
    for rank, out in enumerate(run_workers(_halves, world, timeout=120)):
        for numel in (1, 7, 106, 2**20 + 3):
            assert out[f"owned_{numel}"] <= 1e-6 and out[f"all_{numel}"] <= 1e-6, (rank, numel, out)
            assert out[f"same_{numel}"], (rank, numel)  # bit-identical everywhere: the owner's chunk travels
            a, b = owned_chunk(numel, world, rank)
            sent_rs, sent, calls = out[f"bytes_{numel}"]
            # reduce-scatter: every chunk but the owned one leaves once; all-gather: every chunk but the one
            # received last (the successor's owned one, (rank + 2) % P)
            assert sent_rs == 4 * (numel - (b - a)), (rank, numel)
            c, d = owned_chunk(numel, world, (rank + 1) % world)
            assert sent - sent_rs == 4 * (numel - (d - c)), (rank, numel)
            assert calls == 2
        assert "found a non-contiguous tensor of shape (4, 4)" in out["noncontiguous"]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": params[:2], "lr": 0.01}, {"params": params[2:], "lr": 0.003, "weight_decay": 0.0}],
        weight_decay=0.1,
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {"sgd": _sgd, "adamw": _adamw}


def _model_and_reference(opt: str) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], Any, Any]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return params, ref, OPTIMIZERS[opt](params), OPTIMIZERS[opt](ref)


def _reference_step(
    ref: list[torch.nn.Parameter], opt: torch.optim.Optimizer, grads: list[torch.Tensor], world: int, clip: Any
) -> None:
    """DDP's step: every rank's gradient averaged (gloo), clipped as Lightning does, the optimizer on all of it."""
    for p, g in zip(ref, grads, strict=True):
        avg = g.clone()
        dist.all_reduce(avg)
        p.grad = avg / world
    if clip and clip[0] == "norm":
        torch.nn.utils.clip_grad_norm_(ref, clip[1])
    elif clip:
        torch.nn.utils.clip_grad_value_(ref, clip[1])
    opt.step()


def _steps(rank: int, world: int, opt: str, clip: tuple[str, float] | None, cap_mb: float, order: str) -> Any:
    params, ref, worker_opt, ref_opt = _model_and_reference(opt)
    group = dist.new_group(backend="gloo")
    spec = ClipSpec(clip_val=clip[1], algorithm=clip[0]) if clip else None
    shards = RingShards(params, OptimizerSpec.from_optimizer(worker_opt), group, bucket_cap_mb=cap_mb, clip=spec)
    out: dict[str, Any] = {"buckets": len(shards.buckets)}
    for step in range(4):
        shards.begin_step(worker_opt.param_groups)
        grads = [_grad(rank, step, s) for s in SHAPES]
        indices = list(range(len(params)))
        # the buckets' readiness in another order on every rank: they still meet in bucket order
        indices = indices[::-1] if order == "reversed" and rank % 2 else indices
        for i in indices:
            params[i].grad = grads[i].clone()
            shards.grad_ready(i)
        shards.flush()
        _reference_step(ref, ref_opt, grads, world, clip)
        worker_opt.param_groups[0]["lr"] *= 0.5  # a scheduler: the shards take the worker's options each step
        ref_opt.param_groups[0]["lr"] *= 0.5
    out["diff"] = max(float((p - r).abs().max()) for p, r in zip(params, ref, strict=True))
    out["moved"] = max(float((p - r).abs().max()) for p, r in zip(params, _model_and_reference(opt)[0], strict=True))
    gathered = gather_ring_state(shards, worker_opt.state_dict()["param_groups"])
    want = ref_opt.state_dict()
    out["state_keys"] = sorted(gathered["state"]) == sorted(want["state"])
    out["state_diff"] = max(
        float((torch.as_tensor(v) - torch.as_tensor(want["state"][i][k])).abs().max())
        for i, st in gathered["state"].items()
        for k, v in st.items()
    )
    # resumed: fresh shards loaded from the gathered state take the next step as the reference does
    fresh = RingShards(params, OptimizerSpec.from_optimizer(worker_opt), group, bucket_cap_mb=cap_mb, clip=spec)
    load_ring_state(fresh, gathered)
    fresh.begin_step(worker_opt.param_groups)
    for i, p in enumerate(params):
        p.grad = _grad(rank, 9, SHAPES[i])
    fresh.flush()
    _reference_step(ref, ref_opt, [_grad(rank, 9, s) for s in SHAPES], world, clip)
    out["resumed_diff"] = max(float((p - r).abs().max()) for p, r in zip(params, ref, strict=True))
    out["bytes"] = shards.stats.bytes_sent + fresh.stats.bytes_sent
    shards.close()
    fresh.close()
    return out


# (optimizer, clipping, bucket cap in MiB: 1e-4 is ~26 floats, several buckets; 25: one, order of readiness)
CASES = [
    ("sgd", None, 25.0, "forward"),
    ("adamw", None, 1e-4, "reversed"),
    ("sgd", ("norm", 0.5), 1e-4, "forward"),
    ("adamw", ("value", 0.3), 25.0, "forward"),
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("opt", "clip", "cap_mb", "order"), CASES)
def test_shards_step_as_the_optimizer_on_the_average(
    world: int, opt: str, clip: tuple[str, float] | None, cap_mb: float, order: str
) -> None:
    for out in run_workers(_steps, world, opt, clip, cap_mb, order, timeout=120):
        # 1e-4 MiB = 104-byte caps, in reverse order: 396 | 4 + 96 + 28 | 140 bytes
        assert out["buckets"] == (1 if cap_mb == 25.0 else 3)
        # P=2: (g0 + g1) / 2 is gloo's sum halved, exactly, and each element's update is the optimizer's
        # own arithmetic: bit-identical. P=3: the ring adds the thirds in another order per chunk (~1 ulp of
        # the gradient per step); by norm the shards' float64 sum of squares vs torch's float32 norm of
        # norms (~1e-7 relative); over 5 steps of weights O(1), far below 1e-5.
        tol = 0.0 if world == 2 and not (clip and clip[0] == "norm") else 1e-5
        assert out["diff"] <= tol and out["resumed_diff"] <= tol, out
        assert out["moved"] > 1e-3, out  # the steps did change the weights
        assert out["state_keys"] and out["state_diff"] <= max(tol, 1e-6), out
        assert out["bytes"] > 0


def _unused(rank: int, world: int) -> str:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.SGD(params, lr=0.1)
    shards = RingShards(params, OptimizerSpec.from_optimizer(opt), dist.new_group(backend="gloo"))
    shards.begin_step(opt.param_groups)
    params[0].grad = torch.ones(3)
    try:
        shards.flush()
    except RuntimeError as err:
        return str(err)
    finally:
        shards.close()
    return "no error"


def test_a_tensor_without_gradient_is_named() -> None:
    for message in run_workers(_unused, 2, timeout=60):
        assert "trainable tensor(s) [1] (optimizer order) have no gradient" in message
        assert "Fix: freeze them" in message


def test_refuses_what_a_chunk_cannot_step() -> None:
    from lightning_strategies.optim import Lamb

    params = [torch.nn.Parameter(torch.ones(3))]
    group: Any = None  # refused before the group is used
    with pytest.raises(ValueError, match="found Lamb, which is not an elementwise optimizer"):
        RingShards(params, OptimizerSpec.from_optimizer(Lamb(params, lr=0.1)), group)
    mixed = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="found trainable tensors of 2 dtypes or devices"):
        RingShards(mixed, OptimizerSpec.from_optimizer(torch.optim.SGD(mixed, lr=0.1)), group)


PG_TIMEOUT_S = 20.0


def _dies(rank: int, world: int, out_dir: str) -> None:
    if rank == 1:

        def die_mid_ring(dst: torch.Tensor, src: torch.Tensor) -> None:
            os._exit(1)  # once a peer's segment arrived: mid reduce-scatter

        ring_module._reduce_segment = die_mid_ring  # type: ignore[assignment]  # forked: the victim only
    params = [torch.nn.Parameter(torch.ones(2**16))]
    opt = torch.optim.SGD(params, lr=0.1)
    shards = RingShards(params, OptimizerSpec.from_optimizer(opt), dist.new_group(backend="gloo"))
    shards.begin_step(opt.param_groups)
    params[0].grad = torch.ones(2**16)
    start = time.monotonic()
    result: dict[str, Any] = {}
    try:
        shards.flush()
    except RingPeerError as exc:
        result.update(type="RingPeerError", peer=exc.global_peer, error=str(exc))
    except Exception as exc:  # pragma: no cover - reported by the assertion
        result.update(type=type(exc).__name__, error=repr(exc))
    result["seconds"] = time.monotonic() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shards.close(timeout=0.0)


def test_a_lost_peer_fails_the_step_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed:\nprocess exited with code 1"):
        run_workers(_dies, 2, str(tmp_path), timeout=60, pg_timeout_s=PG_TIMEOUT_S)
    found = json.loads(Path(tmp_path, "rank0.json").read_text())
    assert found["type"] == "RingPeerError" and found["peer"] == 1, found
    assert "peer rank 1" in found["error"], found
    assert found["seconds"] < PG_TIMEOUT_S, found  # a closed connection, not a timeout


def _stream_log(rank: int, world: int) -> list[tuple[Any, ...]]:
    from test_ps_streams import FakeStreams  # the streams' fake backend (no GPU): it logs each order it is given

    streams = FakeStreams()
    params = [torch.nn.Parameter(torch.ones(s)) for s in SHAPES]
    opt = torch.optim.SGD(params, lr=0.1)
    shards = RingShards(
        params, OptimizerSpec.from_optimizer(opt), dist.new_group(backend="gloo"), bucket_cap_mb=1e-4, streams=streams
    )
    push = shards._push

    def logged_push(bucket: Any) -> None:
        streams.mark("push")  # which stream the thread's work is enqueued on
        push(bucket)

    shards._push = logged_push  # type: ignore[method-assign]
    for step in range(2):
        streams.mark(f"step{step}")
        shards.begin_step(opt.param_groups)
        for i, p in enumerate(params):
            p.grad = torch.ones_like(p)
            shards.grad_ready(i)
        shards.flush()
    shards.close()
    return streams.log


def test_on_a_device_the_thread_works_on_its_own_stream_after_the_callers() -> None:
    for log in run_workers(_stream_log, 2, timeout=60):
        for step in range(2):
            start = log.index((f"step{step}", "default"))
            end = log.index(("step1", "default")) if step == 0 else len(log)
            events = log[start + 1 : end]
            # each of the 3 buckets: the shards' stream waits for the caller's (the copy into the bucket), the
            # bucket's work runs on the shards' stream, and the caller's stream waits for it before the values land
            assert events.count(("wait", "shard1", "default")) == 3, events
            assert events.count(("push", "shard1")) == 3, events
            assert events[-1] == ("wait", "default", "shard1"), events
            assert events.index(("wait", "shard1", "default")) < events.index(("push", "shard1")), events


def test_a_checkpoint_without_one_whole_optimizer_state_is_refused() -> None:
    from lightning_strategies.strategies._ps_state import full_optimizer_state

    state = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    assert full_optimizer_state("X", {"optimizer_states": [state]}) == state
    with pytest.raises(
        ValueError, match=r"X found 2 optimizer states in the checkpoint .* expected one full optimizer"
    ):
        full_optimizer_state("X", {"optimizer_states": [state, state]})
    with pytest.raises(ValueError, match=r"X found 1 optimizer states in the checkpoint \(keys \[\['state'\]\]\)"):
        full_optimizer_state("X", {"optimizer_states": [{"state": {}}]})
