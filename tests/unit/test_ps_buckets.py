"""Pushes in parts and buckets, in one process (co-located shards called directly, no RPC): the bucket
plan, a shard taking a worker's step in several parts, and the overlapped push against the one-shot one."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    Slice,
    partition_parameters,
    register_shard,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.ps.buckets import OverlappedPush, StepTimeline, plan_buckets
from lightning_strategies.comm.rpc import ShardError


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 4, generator=g), torch.randn(6, generator=g), torch.randn(3, 6, generator=g)]


def _spec(params: list[torch.Tensor]) -> OptimizerSpec:
    return OptimizerSpec.from_optimizer(torch.optim.SGD([p.clone().requires_grad_(True) for p in params], lr=0.1))


def test_buckets_follow_reverse_order_and_close_at_the_cap() -> None:
    # 4 tensors of 400 bytes, 2 shards of 2 tensors: the first bucket closes at its own (smaller) cap
    plan = [[Slice(0, 0, 100), Slice(1, 0, 100)], [Slice(2, 0, 100), Slice(3, 0, 100)]]
    buckets = plan_buckets([400] * 4, plan, cap_bytes=800, first_cap_bytes=400)
    assert [b.tensors for b in buckets] == [(3,), (2, 1), (0,)]
    # each bucket names, per shard involved, the indices of that shard's slices in it
    assert [b.parts for b in buckets] == [{1: (1,)}, {0: (1,), 1: (0,)}, {0: (0,)}]
    with pytest.raises(ValueError, match="expected at least 1 byte"):
        plan_buckets([4], [[Slice(0, 0, 1)]], cap_bytes=0)


def test_a_tensor_split_across_shards_goes_to_each() -> None:
    plan = partition_parameters([256], 2)  # one tensor, half on each shard
    (bucket,) = plan_buckets([1024], plan, cap_bytes=1 << 20)
    assert bucket.parts == {0: (0,), 1: (0,)}


def test_a_shard_takes_a_step_in_parts_like_in_one_push() -> None:
    params = _params()
    grads = [[torch.full_like(p, w + 1.0) for p in params] for w in range(2)]
    whole = ParameterShard(0, [0, 1, 2], params, _spec(params), 2)
    parts = ParameterShard(0, [0, 1, 2], params, _spec(params), 2)
    futures = [whole.push(w, 0, grads[w], [0.1]) for w in range(2)]
    want = futures[0].wait()
    # worker 0 in two parts (out of order), worker 1 at once
    ack = parts.push(0, 0, [grads[0][2]], [0.1], [2])
    assert ack.done() and ack.wait().values is None and ack.wait().step_bytes == 0  # no values, no bytes
    last = parts.push(0, 0, [grads[0][0], grads[0][1]], [0.1], [0, 1])
    assert not last.done()  # the barrier waits for worker 1
    parts.push(1, 0, grads[1], [0.1])
    got = last.wait()
    assert got.step_bytes == want.step_bytes and got.version == want.version == 1
    for a, b in zip(got.values.flats, want.values.flats, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_part_pushed_twice_and_a_bad_part_are_refused() -> None:
    params = _params()
    shard = ParameterShard(0, [0, 1, 2], params, _spec(params), 2)
    shard.push(0, 0, [torch.ones_like(params[1])], [0.1], [1])
    again = shard.push(0, 0, [torch.ones_like(params[1])], [0.1], [1]).wait()
    assert isinstance(again, ShardError) and "pushed step 0 twice" in again.message
    bad = shard.push(1, 0, [torch.ones_like(params[0])], [0.1], [5]).wait()
    assert isinstance(bad, ShardError) and "expected distinct slices in [0, 3)" in bad.message


def test_timeout_names_a_worker_whose_parts_are_incomplete() -> None:
    params = _params()
    shard = ParameterShard(0, [0, 1, 2], params, _spec(params), 2, timeout=timedelta(seconds=0.3))
    waiting = shard.push(0, 0, [torch.ones_like(p) for p in params], [0.1])
    shard.push(1, 0, [torch.ones_like(params[0])], [0.1], [0])  # worker 1 sends one slice of three
    deadline = time.monotonic() + 10
    while not waiting.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    error = waiting.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert re.search(r"from worker\(s\) \[1\] \(received from \[0\]\)", error.message)


def _register_shards(params: list[torch.Tensor], plan: list[list[Slice]]) -> None:
    for s, slices in enumerate(plan):
        register_shard(ParameterShard(s, slices, [slice_of(params[sl.tensor], sl) for sl in slices], _spec(params), 1))


@pytest.fixture
def two_shards() -> Iterator[tuple[list[torch.Tensor], list[list[Slice]]]]:
    """Two co-located shards over :func:`_params`, split in flat order, for one worker."""
    params = _params()
    plan = partition_parameters([p.numel() for p in params], 2, align=1)
    _register_shards(params, plan)
    yield params, plan
    for s in range(2):
        unregister_shard(s)


def _worker(params: list[torch.Tensor], plan: list[list[Slice]]) -> ParameterServerClient:
    return ParameterServerClient(0, [p.clone() for p in params], plan)


def _set_grads(client: ParameterServerClient, step: int) -> None:
    for i, p in enumerate(client.params):
        p.grad = torch.full_like(p, step + 1.0 + i)


def test_overlapped_push_equals_the_one_shot_push(two_shards: tuple[list[torch.Tensor], list[list[Slice]]]) -> None:
    params, plan = two_shards
    overlapped = _worker(params, plan)
    push = OverlappedPush(
        overlapped, lambda: [0.1], bucket_cap_mb=2e-5, first_bucket_mb=2e-5
    )  # 20 bytes: a bucket per tensor
    assert len(push.buckets) == 3
    for step in range(3):
        _set_grads(overlapped, step)
        for i in reversed(range(len(params))):  # backward's order: every bucket leaves before its end
            push.grad_ready(i)
        push.end_backward()
        push.flush()
        push.wait_for([0])  # the first layer's forward: shard 0 only
        assert set(push.timeline[-1].pull_landed) == {0}
        push.settle()
    assert [t.bytes_before_backward_end for t in push.timeline] == [sum(p.numel() * 4 for p in params)] * 3
    _register_shards(params, plan)  # fresh shards (the same ids) for the one-shot reference
    one_shot = _worker(params, plan)
    for step in range(3):
        _set_grads(one_shot, step)
        one_shot.push_pull([0.1])
    for got, want in zip(overlapped.params, one_shot.params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_tensor_read_before_its_values_landed_is_an_error(
    two_shards: tuple[list[torch.Tensor], list[list[Slice]]],
) -> None:
    params, plan = two_shards
    client = _worker(params, plan)
    push = OverlappedPush(client, lambda: [0.1])
    _set_grads(client, 0)
    push.flush()  # step 0 out; no module waited for its values before the next backward
    with pytest.raises(RuntimeError, match=r"trainable tensor 2 .* got a gradient in step 1, but no module"):
        push.grad_ready(2)


def test_the_peer_watch_aborts_a_wait_for_values(two_shards: tuple[list[torch.Tensor], list[list[Slice]]]) -> None:
    # a frozen host's reply never comes, and TensorPipe does not fail the call when its connection is shut
    # down: the heartbeat's abort hook ends the wait instead of the RPC timeout
    from torch.futures import Future

    from lightning_strategies.comm.ps.buckets import _abort_waits

    params, plan = two_shards
    push = OverlappedPush(_worker(params, plan), lambda: [0.1])
    push.timeline.append(StepTimeline(0))
    push._in_flight = {1: Future()}  # shard 1's reply: never
    timer = threading.Timer(0.2, _abort_waits, args=(None,))
    timer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"shard\(s\) \[1\] at step 0 was aborted: a peer is gone"):
        push.wait_for([2])
    assert time.monotonic() - start < 10
    timer.join()


def test_an_ended_wait_leaves_nothing_on_the_abort() -> None:
    # one wait per module and step: a callback left per wait on a never-set abort would pile up for the whole fit
    from lightning_strategies.comm.ps.client import WaitAbort

    abort = WaitAbort()
    woken: list[str] = []
    for k in range(3):
        abort.unwatch(abort.watch(lambda k=k: woken.append(f"ended wait {k}")))
    key = abort.watch(lambda: woken.append("waiting"))
    abort.set("a peer is gone")
    abort.unwatch(key)
    abort.watch(lambda: woken.append("later"))  # already aborted: at once
    abort.set("another reason")  # the first reason stays
    assert woken == ["waiting", "later"]
    assert abort.reason == "a peer is gone"


def test_the_alignment_runs_once_per_step_after_the_landing_and_before_the_first_push(
    two_shards: tuple[list[torch.Tensor], list[list[Slice]]],
) -> None:
    # what each alignment saw: the values of the last step all landed, no push of this step out yet
    params, plan = two_shards
    client = _worker(params, plan)
    push = OverlappedPush(client, lambda: [0.1], bucket_cap_mb=2e-5, first_bucket_mb=2e-5)  # a bucket per tensor
    seen: list[tuple[int, int, bool]] = []
    client.align = lambda: seen.append((client.step, client.stats.calls, bool(push._due_units())))
    for step in range(4):
        _set_grads(client, step)
        calls = client.stats.calls
        if step % 2 == 0:  # pushed as backward fills the buckets, after a forward that read every tensor
            push.wait_for(range(len(params)))
            for i in reversed(range(len(params))):
                push.grad_ready(i)
            push.end_backward()
        push.flush()  # odd steps: everything pushed here, the last step's values landed here first
        assert seen[-1] == (step, calls, False), seen
        t = push.timeline[-1]
        assert t.aligned is not None and t.first_push is not None and t.aligned <= t.first_push, t
    assert len(seen) == 4
    push.settle()
    # the one-shot push aligns first too; without ``align`` nothing is recorded
    _register_shards(params, plan)
    one_shot = _worker(params, plan)
    order: list[str] = []
    one_shot.align = lambda: order.append(f"align at {one_shot.stats.calls} calls")
    _set_grads(one_shot, 0)
    one_shot.push_pull([0.1])
    assert order == ["align at 0 calls"] and one_shot.stats.calls == 2
    _register_shards(params, plan)
    plain = OverlappedPush(_worker(params, plan), lambda: [0.1])
    plain.flush()
    plain.settle()
    assert plain.timeline[-1].aligned is None
