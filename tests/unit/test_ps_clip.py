"""Gradient clipping on the parameter servers, in one process: shards clipping their slices of the averaged
gradient against ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over the whole of it and against one
``Lamb(max_grad_norm=...)``; the norm agreement's failures; the worker-side pieces of the strategies."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.futures import Future

from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterShard,
    Slice,
    partition_parameters,
    shard_parameters,
    slice_of,
    whole_tensor_slices,
)
from lightning_strategies.comm.ps.clip import ClipSpec, NormAgreement, ShardClipping, send_in_process
from lightning_strategies.comm.rpc import ShardError
from lightning_strategies.optim import Lamb
from lightning_strategies.strategies._ps_clipping import (
    WorkerClippingOff,
    global_norm_max,
    prenormalise_like_lamb,
    server_clip_spec,
)

WORKERS = 2
STEPS = 3
LR = [0.1]  # every optimizer's, pushed with the gradients


def _model(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=g), torch.randn(6, generator=g), torch.randn(3, 6, generator=g)]


def _grad(worker: int, step: int, like: torch.Tensor, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * worker + 10 * step + i)
    return torch.randn(like.shape, generator=g) * (1 + worker)


def _averaged(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """DDP's average (each rank's gradient divided by the world size, then summed)."""
    return [
        sum((_grad(w, step, p, i).div(WORKERS) for w in range(WORKERS)), torch.zeros_like(p))
        for i, p in enumerate(params)
    ]


def _reference(make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], clip: Callable[..., Any] | None):
    """One optimizer over the whole model, the averaged gradient clipped as Lightning clips after DDP."""
    params = [p.clone().requires_grad_(True) for p in _model()]
    opt = make_optimizer(params)
    for step in range(STEPS):
        for p, g in zip(params, _averaged(step, params), strict=True):
            p.grad = g
        if clip is not None:
            clip(params)
        opt.step()
    return [p.detach() for p in params]


def _run_shards(
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    plan: list[list[Slice]],
    spec: ClipSpec,
    **kwargs: Any,
) -> list[torch.Tensor]:
    """Every worker pushes every shard its slices (all in flight, then waited on), for ``STEPS`` steps."""
    params = _model()
    opt_spec = OptimizerSpec.from_optimizer(make_optimizer([p.clone().requires_grad_(True) for p in params]))
    ids = [s for s, slices in enumerate(plan) if slices]
    shards = {
        s: ParameterShard(
            s,
            plan[s],
            [slice_of(params[sl.tensor], sl) for sl in plan[s]],
            opt_spec,
            WORKERS,
            clipping=ShardClipping(spec, s, ids, send=send_in_process, **kwargs),
        )
        for s in ids
    }
    try:
        for step in range(STEPS):
            futures = {
                s: [
                    shard.push(w, step, [slice_of(_grad(w, step, params[sl.tensor], sl.tensor), sl) for sl in sls], LR)
                    for w in range(WORKERS)
                ]
                for s, shard in shards.items()
                if (sls := plan[s])
            }
            for s, futs in futures.items():
                replies = [_wait(f) for f in futs]
                assert all(not isinstance(r, ShardError) for r in replies), replies
                for sl, v in zip(plan[s], shards[s].unpack(replies[0].values), strict=True):
                    assert v is not None
                    flat = params[sl.tensor].reshape(-1).clone()
                    flat[sl.start : sl.stop] = v.reshape(-1)
                    params[sl.tensor] = flat.view(params[sl.tensor].shape)
    finally:
        for shard in shards.values():
            shard.close()
    return params


def _wait(fut: Future[Any], seconds: float = 10.0) -> Any:
    deadline = time.monotonic() + seconds
    while not fut.done():
        assert time.monotonic() < deadline, "a shard's reply did not come"
        time.sleep(0.005)
    return fut.wait()


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _lamb(params: list[torch.Tensor], max_grad_norm: float | None = 0.5) -> torch.optim.Optimizer:
    return Lamb(params, lr=0.1, weight_decay=0.01, max_grad_norm=max_grad_norm)


def _partition(num_servers: int) -> list[list[Slice]]:
    # cuts every 4 elements: slices of one tensor on several shards
    return partition_parameters([p.numel() for p in _model()], num_servers, align=4)


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    # the global norm is summed from per-slice norms in float64, torch's from per-tensor float32 norms:
    # they differ by ~1 ulp of the norm (~1e-7 relative), so the clipped steps of O(0.1) by ~1e-8
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_servers", [2, 3])
@pytest.mark.parametrize("clip_val", [0.5, 100.0], ids=["clips", "below_the_norm"])
def test_norm_clipping_across_shards_equals_clip_grad_norm_of_the_averaged_gradient(
    num_servers: int, clip_val: float
) -> None:
    got = _run_shards(_sgd, _partition(num_servers), ClipSpec(clip_val, "norm"))
    want = _reference(_sgd, lambda ps: torch.nn.utils.clip_grad_norm_(ps, clip_val))
    _assert_close(got, want)
    unclipped = _reference(_sgd, None)
    clipped = any(not torch.allclose(g, u) for g, u in zip(got, unclipped, strict=True))
    assert clipped == (clip_val < 1.0)  # the gradients' norms are ~4: 0.5 clips, 100 does not


@pytest.mark.parametrize("num_servers", [1, 3])
def test_value_clipping_equals_clamp_of_the_averaged_gradient(num_servers: int) -> None:
    got = _run_shards(_sgd, _partition(num_servers), ClipSpec(0.3, "value"))
    want = _reference(_sgd, lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.3))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # elementwise: exactly DDP's
    assert any(not torch.equal(g, u) for g, u in zip(got, _reference(_sgd, None), strict=True))


@pytest.mark.parametrize(
    "spec",
    # the gradients' norms are ~4: clipped to 2 by norm (or clamped by value), then Lamb's bound 0.5
    [ClipSpec(optimizer_norm=True), ClipSpec(2.0, "norm", optimizer_norm=True), ClipSpec(0.3, "value", True)],
    ids=["lamb_only", "norm_then_lamb", "value_then_lamb"],
)
def test_lamb_max_grad_norm_across_shards_equals_one_lamb(spec: ClipSpec) -> None:
    sizes = [p.numel() for p in _model()]
    plan = whole_tensor_slices(shard_parameters(sizes, 3), sizes)  # Lamb keeps whole tensors
    got = _run_shards(_lamb, plan, spec)
    clip: Callable[..., Any] | None = None
    if spec.clips:
        clip_val = float(spec.clip_val or 0)
        if spec.algorithm == "norm":
            clip = lambda ps: torch.nn.utils.clip_grad_norm_(ps, clip_val)  # noqa: E731
        else:
            clip = lambda ps: torch.nn.utils.clip_grad_value_(ps, clip_val)  # noqa: E731
    _assert_close(got, _reference(_lamb, clip))
    # and each shard's own norm would have been another: the agreed one mattered
    alone = _run_shards(_lamb, plan, ClipSpec(spec.clip_val, spec.algorithm))
    assert any(not torch.allclose(g, a) for g, a in zip(got, alone, strict=True))


TwoShards = Callable[..., tuple[list[list[Slice]], list[ParameterShard]]]


@pytest.fixture
def two_shards() -> Iterator[TwoShards]:
    """Makes two shards of one worker that clip by norm (closed after the test: their agreements unregistered)."""
    made: list[ParameterShard] = []

    def make(**kwargs: Any) -> tuple[list[list[Slice]], list[ParameterShard]]:
        plan, shards = _two_shards(**kwargs)
        made.extend(shards)
        return plan, shards

    yield make
    for shard in made:
        shard.close()


def _two_shards(**kwargs: Any) -> tuple[list[list[Slice]], list[ParameterShard]]:
    kwargs.setdefault("send", send_in_process)
    plan = _partition(2)
    params = _model()
    spec = OptimizerSpec.from_optimizer(_sgd([p.clone().requires_grad_(True) for p in params]))
    shards = [
        ParameterShard(
            s,
            plan[s],
            [slice_of(params[sl.tensor], sl) for sl in plan[s]],
            spec,
            1,
            clipping=ShardClipping(ClipSpec(1.0), s, [0, 1], **kwargs),
        )
        for s in (0, 1)
    ]
    return plan, shards


def _ones(plan: list[list[Slice]], s: int) -> list[torch.Tensor | None]:
    params = _model()
    return [slice_of(torch.ones_like(params[sl.tensor]), sl) for sl in plan[s]]


def test_a_missing_shard_part_fails_the_step_naming_the_shard_within_the_timeout(two_shards: TwoShards) -> None:
    plan, shards = two_shards(timeout=timedelta(seconds=0.3))
    start = time.monotonic()
    fut = shards[0].push(0, 0, _ones(plan, 0), [0.1])  # shard 1 never gets its push, so never sends its part
    error = _wait(fut)
    assert time.monotonic() - start < 5
    assert isinstance(error, ShardError) and error.timed_out
    assert re.search(r"shard 0 waited 0s for the gradient-norm parts of step 0 from shard\(s\) \[1\]", error.message)
    # the shard failed: a later push is refused, not hung
    late = shards[0].push(0, 0, _ones(plan, 0), [0.1]).wait()
    assert isinstance(late, ShardError) and "has failed earlier" in late.message


def test_an_undeliverable_part_fails_the_step_at_once(two_shards: TwoShards) -> None:
    def send(to: int, sender: int, step: int, part: float) -> Future[Any]:
        raise RuntimeError(f"connection to rank {to} refused")

    plan, shards = two_shards(send=send)  # timeout 30 minutes: only the failed send can end the wait
    error = _wait(shards[0].push(0, 0, _ones(plan, 0), [0.1]), seconds=5)
    assert isinstance(error, ShardError) and not error.timed_out
    assert "could not send its gradient-norm part of step 0 to shard 1" in error.message
    assert "connection to rank 1 refused" in error.message


def test_closing_a_shard_fails_its_open_agreement_with_the_reason(two_shards: TwoShards) -> None:
    plan, shards = two_shards()
    fut = shards[0].push(0, 0, _ones(plan, 0), [0.1])
    assert not fut.done()
    shards[0].close("PeerLostError: lost peer rank 1 of 2")
    error = _wait(fut, seconds=5)
    assert isinstance(error, ShardError) and "lost peer rank 1 of 2" in error.message


def test_parts_that_arrive_before_the_shard_opens_its_round_count() -> None:
    opened: list[Future[Any]] = []
    delivered = threading.Event()
    agreements: dict[int, NormAgreement] = {}

    def send(to: int, sender: int, step: int, part: float) -> Future[Any]:
        agreements[to].receive(sender, step, part)
        delivered.set()
        fut: Future[Any] = Future()
        fut.set_result(None)
        return fut

    agreements[0] = NormAgreement(0, [0, 1], send=send)
    agreements[1] = NormAgreement(1, [0, 1], send=send)
    opened.append(agreements[1].open(0, 9.0))  # shard 1 first: its part waits at shard 0
    assert delivered.is_set() and not opened[0].done()
    opened.append(agreements[0].open(0, 16.0))
    assert [f.wait() for f in opened] == [5.0, 5.0]  # sqrt(9 + 16), the same float on both
    for a in agreements.values():
        a.close()


def test_clip_spec_checks_its_options() -> None:
    with pytest.raises(ValueError, match=r"ClipSpec\(algorithm='l1'\): expected one of \['norm', 'value'\]"):
        ClipSpec(1.0, "l1")
    with pytest.raises(ValueError, match=r"ClipSpec\(clip_val=-1.0\): expected None or a value >= 0"):
        ClipSpec(-1.0)
    assert not ClipSpec(0.0).needs_norm and ClipSpec(1.0).needs_norm and not ClipSpec(1.0, "value").needs_norm


def test_worker_clipping_off_switches_the_plugin_off_and_back() -> None:
    plugin = Precision()
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), 5.0)
    opt = torch.optim.SGD([p], lr=0.1)
    off = WorkerClippingOff(plugin)
    plugin.clip_gradients(opt, 1.0)
    assert torch.equal(p.grad, torch.full((3,), 5.0))  # the worker pushes its gradient unclipped
    off.restore()
    plugin.clip_gradients(opt, 1.0, "value")
    assert torch.equal(p.grad, torch.ones(3))


def test_async_prenormalisation_is_lambs_own_rule() -> None:
    # Lamb(max_grad_norm) on a gradient == Lamb without it on the gradient the async worker pre-normalised
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    params = [*_model()[:1], torch.randn(5, 3)]
    results = []
    for max_grad_norm, prenormalise in ((0.5, False), (None, True)):
        xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(7)).requires_grad_(True) for _ in params]
        gs = [g.clone() for g in grads]
        if prenormalise:
            prenormalise_like_lamb(gs, 0.5)
        for x, g in zip(xs, gs, strict=True):
            x.grad = g
        _lamb(xs, max_grad_norm).step()
        results.append([x.detach() for x in xs])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


class _SGDWithMaxNorm(torch.optim.SGD):
    def __init__(self, params: Any, lr: float = 0.1, max_grad_norm: float | None = None) -> None:
        super().__init__(params, lr=lr)
        self.defaults["max_grad_norm"] = max_grad_norm


def test_only_lamb_takes_the_global_norm_over_several_shards() -> None:
    params = [p.clone().requires_grad_(True) for p in _model()]
    lamb = _lamb(params)
    assert global_norm_max("ps", lamb, OptimizerSpec.from_optimizer(lamb), 2) == 0.5
    assert global_norm_max("ps", lamb, OptimizerSpec.from_optimizer(lamb), 1) is None  # one shard: Lamb's own
    other = _SGDWithMaxNorm(params, max_grad_norm=1.0)
    message = r"found _SGDWithMaxNorm\(max_grad_norm=1.0\) with num_servers=2: .* Fix: use Lamb"
    with pytest.raises(ValueError, match=message):
        global_norm_max("ParameterServerStrategy", other, OptimizerSpec.from_optimizer(other), 2)


class _OwnClipping(pl.LightningModule):
    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_server_clip_spec_follows_the_trainer_and_refuses_a_custom_hook() -> None:
    trainer = SimpleNamespace(gradient_clip_val=0.5, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    spec = server_clip_spec("ps", trainer, pl.LightningModule(), optimizer_norm=False)  # type: ignore[arg-type]
    assert spec == ClipSpec(0.5, "value")
    off = SimpleNamespace(gradient_clip_val=None, gradient_clip_algorithm=None)
    assert server_clip_spec("ps", off, pl.LightningModule(), optimizer_norm=False) is None  # type: ignore[arg-type]
    lamb_only = server_clip_spec("ps", off, pl.LightningModule(), optimizer_norm=True)  # type: ignore[arg-type]
    assert lamb_only == ClipSpec(optimizer_norm=True)
    with pytest.raises(ValueError, match=r"found _OwnClipping.configure_gradient_clipping overridden: .* Fix: remove"):
        server_clip_spec("ParameterServerStrategy", off, _OwnClipping(), optimizer_norm=False)  # type: ignore[arg-type]
