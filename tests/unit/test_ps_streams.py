"""The parameter servers' CUDA stream order, checked on CPU with a fake stream backend, and the
snapshot semantics of the shards' replies (a reply is a copy that no later step changes).

The fake backend (:class:`FakeStreams`) names streams, keeps each thread's current one and logs
every wait, record_stream and completed future, so a test can assert which stream waits on which
and in what order, as ``torch.cuda`` would enqueue it (the real path: ``tests/gpu/test_ps_gpu.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.futures import Future

from lightning_strategies.comm.async_ps import AsyncParameterShard, _rpc_async_pull, _rpc_async_push
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    Slice,
    pack,
    partition_parameters,
    register_shard,
    slice_of,
    unpack,
    unregister_shard,
)
from lightning_strategies.comm.streams import StreamOrder


class FakeFuture(Future[Any]):
    """A stream-aware future as torch makes them with ``devices=``: ``set_result`` records an event on
    the current stream, ``wait`` makes the waiter's current stream wait on it."""

    def __init__(self, streams: FakeStreams) -> None:
        super().__init__()
        self.streams = streams
        self.event_on: str | None = None

    def set_result(self, result: Any) -> None:
        self.event_on = self.streams.current_stream(None)
        self.streams.log.append(("complete", self.event_on))
        super().set_result(result)

    def wait(self) -> Any:
        value = super().wait()
        assert self.event_on is not None
        self.streams.wait(self.streams.current_stream(None), self.event_on)
        return value


class FakeStreams:
    """A :class:`~lightning_strategies.comm.streams.StreamBackend` that logs what it is asked."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._local = threading.local()
        self._made = 0

    def new_stream(self, device: Any) -> str:
        self._made += 1
        return f"shard{self._made}"

    def current_stream(self, device: Any) -> str:
        return getattr(self._local, "stream", "default")

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        before = self.current_stream(None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def wait(self, waiter: Any, producer: Any) -> None:
        self.log.append(("wait", waiter, producer))

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("keep", tensor.untyped_storage().data_ptr(), stream))

    def future(self, device: Any) -> Future[Any]:
        return FakeFuture(self)

    def mark(self, what: str) -> None:
        self.log.append((what, self.current_stream(None)))


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).requires_grad_(True) for s in ((6, 4), (6,), (3, 6))]


def _shard(streams: FakeStreams, num_workers: int, *, cls: type[ParameterShard] = ParameterShard) -> ParameterShard:
    params = _params()
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    shard = cls(0, list(range(len(params))), params, spec, num_workers, streams=streams)
    step = shard._step

    def logged_step(*args: Any, **kwargs: Any) -> Any:
        streams.mark("step")  # the stream current while the optimizer step is enqueued
        return step(*args, **kwargs)

    shard._step = logged_step  # type: ignore[method-assign]
    return shard


def _grads(seed: int) -> list[torch.Tensor | None]:
    """One worker's gradients as a push delivers them: views into one packed payload."""
    g = torch.Generator().manual_seed(seed)
    params = _params()
    return unpack(pack([torch.randn(p.shape, generator=g) for p in params]), params)


def _storage(t: torch.Tensor | None) -> int:
    assert t is not None
    return t.untyped_storage().data_ptr()


def test_sync_step_waits_for_every_pushers_stream_and_replies_on_the_shard_stream() -> None:
    streams = FakeStreams()
    shard = _shard(streams, num_workers=2)
    assert ("wait", "shard1", "default") in streams.log  # the constructor's clones come first
    streams.log.clear()
    g0, g1 = _grads(0), _grads(1)
    with streams.use("rpc0"):  # worker 0's push arrived on TensorPipe stream "rpc0"
        first = shard.push(0, 0, g0, [0.1])
    with streams.use("rpc1"):
        second = shard.push(1, 0, g1, [0.1])
    assert isinstance(first, FakeFuture) and isinstance(second, FakeFuture)
    assert streams.log == [
        # each push: the shard stream waits for the stream its gradients came on, and their memory
        # (one payload: one storage) is kept until the shard stream has read it
        ("wait", "shard1", "rpc0"),
        ("keep", _storage(g0[0]), "shard1"),
        ("wait", "shard1", "rpc1"),
        ("keep", _storage(g1[0]), "shard1"),
        # the step, by whichever thread pushed last, on the shard stream; then both replies
        ("step", "shard1"),
        ("complete", "shard1"),
        ("complete", "shard1"),
    ]
    # a worker waiting for its reply orders its own stream after the shard's
    streams.log.clear()
    with streams.use("worker0"):
        reply = first.wait()
    assert streams.log == [("wait", "worker0", "shard1")]
    assert reply is second.wait()  # one snapshot for all workers


def test_async_pushes_run_in_lock_order_on_one_stream_and_hand_back_their_snapshot() -> None:
    streams = FakeStreams()
    shard = _shard(streams, num_workers=2, cls=AsyncParameterShard)
    assert isinstance(shard, AsyncParameterShard)
    streams.log.clear()
    g0, g1 = _grads(0), _grads(1)
    with streams.use("rpc0"):
        r0 = shard.push_pull(0, g0, [0.1], pull=True)
    with streams.use("rpc1"):
        r1 = shard.push_pull(1, g1, [0.1], pull=False)
    assert not isinstance(r0, Exception) and not isinstance(r1, Exception)
    assert r0.values is not None and r1.values is None  # type: ignore[union-attr]
    snapshot = r0.values.flats[0]  # type: ignore[union-attr]
    assert streams.log == [
        ("wait", "shard1", "rpc0"),
        ("keep", _storage(g0[0]), "shard1"),
        ("step", "shard1"),
        # a synchronous reply: the caller's stream (the one TensorPipe sends from) waits for the
        # shard stream, and the snapshot's memory is kept for it
        ("wait", "rpc0", "shard1"),
        ("keep", snapshot.untyped_storage().data_ptr(), "rpc0"),
        ("wait", "shard1", "rpc1"),
        ("keep", _storage(g1[0]), "shard1"),
        ("step", "shard1"),
        ("wait", "rpc1", "shard1"),  # nothing pulled: nothing to keep
    ]


def test_co_located_worker_copies_the_reply_after_its_stream_waited_for_the_shard() -> None:
    streams = FakeStreams()
    params = _params()
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1))
    plan = partition_parameters([p.numel() for p in params], 1)
    mine = [slice_of(params[s.tensor], s) for s in plan[0]]
    register_shard(ParameterShard(0, plan[0], mine, spec, 1, streams=streams))
    try:
        client = ParameterServerClient(0, params, plan)
        apply = client._apply_reply

        def logged_apply(s: int, reply: Any) -> None:
            streams.mark("copy into the model")
            apply(s, reply)

        client._apply_reply = logged_apply  # type: ignore[method-assign]
        for p in params:
            p.grad = torch.ones_like(p)
        streams.log.clear()
        with streams.use("train"):
            client.push_pull([0.1])
        kinds = [entry[:2] if entry[0] != "wait" else entry for entry in streams.log]
        assert kinds == [
            ("wait", "shard1", "train"),  # the packed gradients were made on the training stream
            ("keep", kinds[1][1]),
            ("complete", "shard1"),  # the step ran on "shard1" (checked above), then the reply
            ("wait", "train", "shard1"),  # Future.wait, before ...
            ("copy into the model", "train"),  # ... the copy into the parameters
        ]
    finally:
        unregister_shard(0)


def test_async_entry_points_order_the_co_located_worker_too() -> None:
    streams = FakeStreams()
    shard = _shard(streams, num_workers=1, cls=AsyncParameterShard)
    register_shard(shard)
    try:
        streams.log.clear()
        with streams.use("train"):
            reply = _rpc_async_pull(0, 0)
        assert not isinstance(reply, Exception)
        assert streams.log[0] == ("wait", "train", "shard1")
        streams.log.clear()
        with streams.use("train"):
            _rpc_async_push(0, 0, pack([torch.ones(p.shape) for p in _params()]), [0.1], False)
        assert streams.log[0] == ("wait", "shard1", "train") and streams.log[-1] == ("wait", "train", "shard1")
    finally:
        unregister_shard(0)


def test_state_and_values_are_copies_ordered_for_the_caller() -> None:
    streams = FakeStreams()
    shard = _shard(streams, num_workers=1)
    shard.push(0, 0, _grads(0), [0.1]).wait()
    streams.log.clear()
    with streams.use("train"):
        state = shard.state_dict()
        values = shard.values()
    momentum = state["state"][Slice(0, 0, 24)]["momentum_buffer"]
    assert ("wait", "train", "shard1") in streams.log
    assert ("keep", momentum.untyped_storage().data_ptr(), "train") in streams.log
    before = momentum.clone(), [v.clone() for v in values]
    shard.push(0, 1, _grads(1), [0.1]).wait()
    # a later step changed the shard, not what was handed out
    torch.testing.assert_close(momentum, before[0], rtol=0, atol=0)
    for got, want in zip(values, before[1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(shard.params[0].detach(), values[0])


def test_sync_reply_is_a_snapshot_that_a_later_step_does_not_change() -> None:
    shard = _shard(FakeStreams(), num_workers=1)
    reply = shard.push(0, 0, _grads(0), [0.1]).wait()
    assert not isinstance(reply, Exception)
    held = [f.clone() for f in reply.values.flats]  # type: ignore[union-attr]
    live = pack(shard.params).flats
    for f, h in zip(reply.values.flats, held, strict=True):  # type: ignore[union-attr]
        assert f.untyped_storage().data_ptr() not in {p.untyped_storage().data_ptr() for p in shard.params}
        torch.testing.assert_close(f, h, rtol=0, atol=0)
    torch.testing.assert_close(live[0], held[0], rtol=0, atol=0)  # the values after step 0
    shard.push(0, 1, _grads(1), [0.1]).wait()
    for f, h in zip(reply.values.flats, held, strict=True):  # type: ignore[union-attr]
        torch.testing.assert_close(f, h, rtol=0, atol=0)  # step 1 left the reply of step 0 alone
    assert not torch.equal(pack(shard.params).flats[0], held[0])


def test_async_reply_is_a_snapshot_that_a_later_push_does_not_change() -> None:
    shard = _shard(FakeStreams(), num_workers=2, cls=AsyncParameterShard)
    assert isinstance(shard, AsyncParameterShard)
    reply = shard.push_pull(0, _grads(0), [0.1], pull=True)
    assert not isinstance(reply, Exception) and reply.values is not None  # type: ignore[union-attr]
    held = reply.values.flats[0].clone()  # type: ignore[union-attr]
    shard.push_pull(1, _grads(1), [0.1], pull=False)  # worker 1's push updates the shard meanwhile
    torch.testing.assert_close(reply.values.flats[0], held, rtol=0, atol=0)  # type: ignore[union-attr]
    assert not torch.equal(pack(shard.params).flats[0], held)


def test_cpu_order_is_inert_and_one_device_is_required() -> None:
    order = StreamOrder.for_tensors([torch.zeros(2)])
    assert not order.active and order.stream is None
    fut = order.reply(torch.ones(1))  # a plain future on CPU
    assert type(fut) is Future and torch.equal(fut.wait(), torch.ones(1))
    order.take([torch.zeros(1)])
    order.give([torch.zeros(1)])
    with pytest.raises(ValueError, match=r"found tensors on \['cpu', 'meta'\]: expected one device"):
        StreamOrder.for_tensors([torch.zeros(2), torch.empty(2, device="meta")])
