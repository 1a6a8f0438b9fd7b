"""A shard that steps and answers each part on its own (``ParameterShard(reply_per_part=True)``, the strategy's
``reply_per_bucket``), in one process (co-located shards called directly, no RPC), against one step and one
reply per shard; the option's checks. On 2 processes against DDP: ``tests/integration/test_ps_overlap.py``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from lightning_strategies import AsyncParameterServerStrategy, ParameterServerStrategy
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    ShardReply,
    Slice,
    partition_parameters,
    register_shard,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.ps.bucket_replies import BucketwisePush
from lightning_strategies.comm.ps.buckets import OverlappedPush, bucket_caps, plan_buckets
from lightning_strategies.comm.ps.clip import ClipSpec, ShardClipping
from lightning_strategies.comm.ps.plan import partition_per_group
from lightning_strategies.comm.rpc import ShardError
from lightning_strategies.optim import Lamb
from lightning_strategies.strategies._ps_overlap import partition_per_bucket, plan_reply_per_bucket


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 4, generator=g), torch.randn(6, generator=g), torch.randn(3, 6, generator=g)]


def _spec(params: list[torch.Tensor], optimizer: type[torch.optim.Optimizer] = torch.optim.Adam) -> OptimizerSpec:
    return OptimizerSpec.from_optimizer(optimizer([p.clone().requires_grad_(True) for p in params], lr=0.1))


def _grads(params: list[torch.Tensor], step: int, worker: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.fixture
def make_shard() -> Iterator[Callable[..., ParameterShard]]:
    """``ParameterShard(0, [0, 1, 2], params, spec, 2, **options)``, closed after the test (its watchdog ended)."""
    made: list[ParameterShard] = []

    def make(params: list[torch.Tensor], spec: OptimizerSpec, **options: Any) -> ParameterShard:
        made.append(ParameterShard(0, [0, 1, 2], params, spec, 2, **options))
        return made[-1]

    yield make
    for shard in made:
        shard.close()


def _values(reply: ShardReply) -> list[torch.Tensor]:
    assert reply.values is not None
    return list(torch.cat([f.reshape(-1) for f in reply.values.flats]).unbind())


def test_each_part_is_stepped_and_answered_once_every_worker_pushed_it(
    make_shard: Callable[..., ParameterShard],
) -> None:
    # Adam (per-tensor state: a step count and two moments) over 3 steps; the workers push their parts in different
    # orders, and the union of the part replies equals the whole shard's reply bit for bit
    params = _params()
    whole = make_shard(params, _spec(params))
    parts = make_shard(params, _spec(params), reply_per_part=True)
    for step in range(3):
        grads = [_grads(params, step, w) for w in range(2)]
        futures = [whole.push(w, step, grads[w], [0.1]) for w in range(2)]
        want = futures[0].wait()
        late = parts.push(0, step, [grads[0][0], grads[0][1]], [0.1], [0, 1])
        first = parts.push(1, step, [grads[1][2]], [0.1], [2])
        assert not late.done() and not first.done()  # slice 2: worker 0 has not pushed it yet
        early = parts.push(0, step, [grads[0][2]], [0.1], [2])
        # slice 2 is in from both: stepped and answered while slices 0 and 1 still wait for worker 1
        assert early.done() and first.done() and not late.done()
        assert early.wait().part == (2,) and early.wait().version == step  # the step is not over
        assert parts.version == step
        last = parts.push(1, step, [grads[1][0], grads[1][1]], [0.1], [0, 1])
        assert late.done() and last.done() and parts.version == step + 1
        replies = {r.part: r for r in (early.wait(), late.wait())}
        assert set(replies) == {(2,), (0, 1)} and replies[(0, 1)].version == step + 1
        assert max(r.step_bytes for r in replies.values()) == want.step_bytes  # the step's bytes, in and out
        got = [*_values(replies[(0, 1)]), *_values(replies[(2,)])]
        by_slice = {0: params[0].numel(), 1: params[1].numel(), 2: params[2].numel()}
        flat_want = _values(want)
        expect = [*flat_want[: by_slice[0] + by_slice[1]], *flat_want[by_slice[0] + by_slice[1] :]]
        torch.testing.assert_close(torch.stack(got), torch.stack(expect), rtol=0, atol=0)
        assert first.wait().values is not None and first.wait().part == (2,)
    for a, b in zip(parts.params, whole.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_whole_push_is_one_part(make_shard: Callable[..., ParameterShard]) -> None:
    params = _params()
    shard = make_shard(params, _spec(params), reply_per_part=True)
    futures = [shard.push(w, 0, _grads(params, 0, w), [0.1]) for w in range(2)]
    replies = [f.wait() for f in futures]
    assert all(isinstance(r, ShardReply) and r.part is None and r.version == 1 for r in replies)


def test_the_timeout_fails_the_parts_left_open_and_names_the_missing_worker(
    make_shard: Callable[..., ParameterShard],
) -> None:
    params = _params()
    shard = make_shard(params, _spec(params), timeout=timedelta(seconds=0.3), reply_per_part=True)
    done = shard.push(0, 0, [torch.ones_like(params[0])], [0.1], [0])
    waiting = shard.push(0, 0, [torch.ones_like(params[1]), torch.ones_like(params[2])], [0.1], [1, 2])
    shard.push(1, 0, [torch.ones_like(params[0])], [0.1], [0])  # worker 1 sends slice 0 only
    assert isinstance(done.wait(), ShardReply)  # slice 0 is in from both: answered
    deadline = time.monotonic() + 10
    while not waiting.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    error = waiting.wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert "from worker(s) [1] (received from [0])" in error.message


def test_a_host_failure_fails_the_parts_left_open(make_shard: Callable[..., ParameterShard]) -> None:
    params = _params()
    shard = make_shard(params, _spec(params), reply_per_part=True)
    open_part = shard.push(0, 0, [torch.ones_like(params[0])], [0.1], [0])
    shard.close("PeerLostError: rank 1 is gone")
    error = open_part.wait()
    assert isinstance(error, ShardError) and "rank 1 is gone" in error.message


def test_a_failing_step_fails_every_waiting_worker_and_later_pushes(make_shard: Callable[..., ParameterShard]) -> None:
    params = _params()
    shard = make_shard(params, _spec(params), reply_per_part=True)

    def boom() -> None:
        raise RuntimeError("boom")

    shard.optimizer.step = boom  # type: ignore[method-assign,union-attr]
    waiting = shard.push(0, 0, [torch.ones_like(params[1]), torch.ones_like(params[2])], [0.1], [1, 2])
    stepping = [shard.push(w, 0, [torch.ones_like(params[0])], [0.1], [0]) for w in range(2)]
    for fut in (waiting, *stepping):
        error = fut.wait()
        assert isinstance(error, ShardError) and "shard 0 failed in step 0: RuntimeError('boom')" in error.message
    later = shard.push(1, 0, [torch.ones_like(params[1])], [0.1], [1]).wait()
    assert isinstance(later, ShardError) and "has failed earlier" in later.message


def test_it_is_refused_where_a_part_alone_cannot_step(make_shard: Callable[..., ParameterShard]) -> None:
    params = _params()
    with pytest.raises(ValueError, match=r"found Lamb \(not elementwise\).*Fix: pass reply_per_part=False"):
        make_shard(params, _spec(params, Lamb), reply_per_part=True)
    clipping = ShardClipping(ClipSpec(clip_val=1.0), 0, [0])
    with pytest.raises(ValueError, match=r"found clipping \(a global norm over every tensor\)"):
        make_shard(params, _spec(params), clipping=clipping, reply_per_part=True)


def _per_part_shards(plan: list[list[Slice]], workers: int) -> Iterator[tuple[list[torch.Tensor], list[list[Slice]]]]:
    """Co-located shards answering per part over :func:`_params` as ``plan`` splits them, unregistered after."""
    params = _params()
    for s, slices in enumerate(plan):
        shard_params = [slice_of(params[sl.tensor], sl) for sl in slices]
        register_shard(ParameterShard(s, slices, shard_params, _spec(params), workers, reply_per_part=True))
    yield params, plan
    for s in range(len(plan)):
        unregister_shard(s)


@pytest.fixture
def per_part_shards() -> Iterator[tuple[list[torch.Tensor], list[list[Slice]]]]:
    """Two shards answering per part, over :func:`_params` split in flat order, for one worker."""
    yield from _per_part_shards(partition_parameters([p.numel() for p in _params()], 2, align=1), 1)


def test_the_overlapped_push_lands_part_replies_like_one_step_per_shard(
    per_part_shards: tuple[list[torch.Tensor], list[list[Slice]]],
) -> None:
    params, plan = per_part_shards
    client = ParameterServerClient(0, [p.clone() for p in params], plan)
    push = OverlappedPush(client, lambda: [0.1], bucket_cap_mb=2e-5, first_bucket_mb=2e-5)  # a bucket per tensor
    for step in range(3):
        for i, p in enumerate(client.params):
            p.grad = _grads(params, step, 0)[i]
        for i in reversed(range(len(params))):
            push.grad_ready(i)
        push.end_backward()
        push.flush()
        push.settle()
    # the reference: a plain Adam on one device (one worker: the servers' mean is its gradient)
    ref = [p.clone().requires_grad_(True) for p in params]
    adam = torch.optim.Adam(ref, lr=0.1)
    for step in range(3):
        for i, p in enumerate(ref):
            p.grad = _grads(params, step, 0)[i]
        adam.step()
    for got, want in zip(client.params, ref, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    assert client.last_server_bytes[0] > 0 and client.last_server_bytes[1] > 0


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"reply_per_bucket='yes'.*expected None .*True or False"):
        ParameterServerStrategy(reply_per_bucket="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reply_per_bucket=True, overlap=False.*Fix: drop overlap=False"):
        ParameterServerStrategy(reply_per_bucket=True, overlap=False)
    with pytest.raises(ValueError, match=r"AsyncParameterServerStrategy\(reply_per_bucket=True\).*own schedules"):
        AsyncParameterServerStrategy(reply_per_bucket=True)
    assert ParameterServerStrategy(reply_per_bucket=True).replies_per_bucket is False  # decided at setup


@pytest.mark.parametrize(
    ("option", "nodes", "overlap", "flat", "optimizer", "clipping", "expected"),
    [
        (None, 4, True, True, torch.optim.SGD, False, True),  # the flat push across nodes (4 x 1)
        (None, 4, True, True, torch.optim.AdamW, False, True),
        (None, 1, True, True, torch.optim.SGD, False, False),  # one node: the loopback does not pay it back
        (None, 4, False, True, torch.optim.SGD, False, False),  # one push after backward (or 16-mixed)
        (None, 2, True, False, torch.optim.SGD, False, False),  # the hierarchical push (2 x 2)
        (None, 4, True, True, Lamb, False, False),  # layer-wise: kept whole, and not in the elementwise set
        (None, 4, True, True, torch.optim.SGD, True, False),  # clipping's global norm
        (False, 4, True, True, torch.optim.SGD, False, False),
        (True, 1, True, True, torch.optim.SGD, False, True),  # asked for on one node
    ],
)
def test_where_it_applies(
    option: bool | None,
    nodes: int,
    overlap: bool,
    flat: bool,
    optimizer: type[torch.optim.Optimizer],
    clipping: bool,
    expected: bool,
) -> None:
    spec = _spec(_params(), optimizer)
    got = plan_reply_per_bucket("PS", option, overlap=overlap, flat=flat, spec=spec, clipping=clipping, num_nodes=nodes)
    assert got is expected


def test_true_names_what_rules_it_out() -> None:
    spec = _spec(_params(), Lamb)
    with pytest.raises(ValueError, match=r"PS\(reply_per_bucket=True\) found the hierarchical push .*; Lamb, which"):
        plan_reply_per_bucket("PS", True, overlap=True, flat=False, spec=spec, clipping=False, num_nodes=2)
    with pytest.raises(ValueError, match=r"found no overlapped push \(overlap=False, or 16-mixed"):
        plan_reply_per_bucket("PS", True, overlap=False, flat=True, spec=_spec(_params()), clipping=False, num_nodes=1)


# -- the plan per bucket ----------------------------------------------------------------------------


def test_each_group_is_split_evenly_over_the_shards() -> None:
    sizes = [1000, 10, 3000, 20, 640]
    groups = [[4, 3, 2], [1, 0]]  # as bucket_groups makes them: reverse order
    plan = partition_per_group(sizes, groups, 4, align=8)
    for group in groups:
        total = sum(sizes[i] for i in group)
        held = [sum(sl.numel for sl in shard if sl.tensor in group) for shard in plan]
        assert max(held) - min(held) <= 2 * 8, (group, held)  # each shard about 1/4 of the group
        assert sum(held) == total
    # every element once: each tensor's slices tile it
    for i, n in enumerate(sizes):
        pieces = sorted((sl.start, sl.stop) for shard in plan for sl in shard if sl.tensor == i)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert all(shard == sorted(shard) for shard in plan)  # flat order
    # one group is the plain partition
    assert partition_per_group(sizes, [range(5)], 4, align=8) == partition_parameters(sizes, 4, align=8)
    with pytest.raises(ValueError, match=r"expected every tensor index in \[0, 5\) in exactly one group"):
        partition_per_group(sizes, [[0, 1], [1, 2, 3, 4]], 4)


def test_the_plan_per_bucket_gives_every_shard_part_of_every_bucket() -> None:
    params = [torch.zeros(256, 64), torch.zeros(64), torch.zeros(64, 64), torch.zeros(64)]
    cap_mb = 16000 / 2**20  # 16 kB buckets (the first too: a cap under 1 MiB sets it)
    plan = partition_per_bucket(params, 2, bucket_cap_mb=cap_mb)
    buckets = plan_buckets([p.numel() * 4 for p in params], plan, **bucket_caps(cap_mb, cap_mb))
    assert [b.tensors for b in buckets] == [(3, 2), (1, 0)]
    for bucket in buckets:
        assert set(bucket.parts) == {0, 1}, bucket  # both shards hold part of every bucket


# -- landing per bucket ----------------------------------------------------------------------------


@pytest.fixture
def two_workers_two_shards() -> Iterator[tuple[list[torch.Tensor], list[list[Slice]]]]:
    """Two shards answering per part, for two workers, each bucket (one tensor) split over both."""
    yield from _per_part_shards(partition_per_group([p.numel() for p in _params()], [[2], [1], [0]], 2, align=1), 2)


def test_a_module_waits_only_for_its_own_buckets_replies(
    two_workers_two_shards: tuple[list[torch.Tensor], list[list[Slice]]],
) -> None:
    params, plan = two_workers_two_shards
    clients = [ParameterServerClient(w, [p.clone() for p in params], plan) for w in range(2)]
    pushes = [BucketwisePush(c, lambda: [0.1], bucket_cap_mb=2e-5, first_bucket_mb=2e-5) for c in clients]
    assert [b.tensors for b in pushes[0].buckets] == [(2,), (1,), (0,)]
    assert all(set(b.parts) == {0, 1} for b in pushes[0].buckets)
    for w, client in enumerate(clients):
        for i, p in enumerate(client.params):
            p.grad = _grads(params, 0, w)[i]
    # worker 0 pushes all three buckets, worker 1 only tensor 0's (the first layer's, the last bucket)
    for i in (2, 1, 0):
        pushes[0].grad_ready(i)
    pushes[0].end_backward()
    pushes[0].flush()
    pushes[1].grad_ready(0)  # bucket 2 holds tensor 0 alone: pushed at once
    before = clients[0].params[1].clone()
    pushes[0].wait_for([0])  # the first layer's forward: bucket 2 alone, which both workers pushed
    assert set(pushes[0].timeline[-1].pull_landed) == {2}
    assert not torch.equal(clients[0].params[0], params[0])  # its new values are in
    assert torch.equal(clients[0].params[1], before)  # tensor 1's bucket is still out
    # worker 1 finishes its step: every bucket lands, and both workers hold the same values
    for i in (1, 2):
        pushes[1].grad_ready(i)
    pushes[1].end_backward()
    pushes[1].flush()
    for push in pushes:
        push.settle()
    assert set(pushes[0].timeline[-1].pull_landed) == {0, 1, 2}
    for a, b in zip(clients[0].params, clients[1].params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert clients[0].last_server_bytes == clients[1].last_server_bytes and min(clients[0].last_server_bytes) > 0
