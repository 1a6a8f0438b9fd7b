"""The async coordinator and the worker's lease in one process, against the math of the SSP bound
and the old one-draw-per-step gate.

The reference for the bound is its definition: with ``max_staleness=s`` no worker starts step
``c+1`` before every other worker has pushed ``c-s`` times, i.e. at every step start
``clock(w) - min_{v != w} clock(v) <= s`` with the workers' *actual* clocks. A random schedule
(seeded) drives several workers through whole epochs, their clock reports delivered late, and
checks that inequality at every step, that every batch is trained exactly once, and that the
schedule never deadlocks. With leases of one batch the coordinator must admit a refill exactly
when the old per-step gate admitted a draw (``min_other >= clock - s``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from lightning_strategies.comm.async_ import (
    AsyncCoordinator,
    BatchLease,
    DataPlan,
    LeasedBatch,
    LeaseReply,
    register_coordinator,
    unregister_coordinator,
)
from lightning_strategies.comm.rpc import ShardError

PLAN = DataPlan(num_samples=20, batch_size=4, drop_last=False, shuffle=True, seed=3)


def _refill(
    c: AsyncCoordinator, worker: int, want: int, clock: int = 0, epoch: int = 0, **kw: Any
) -> LeaseReply | None:
    """The answer if given at once, else ``None`` (the refill is held)."""
    fut = c.refill(worker, epoch, want, clock=clock, plan=kw.pop("plan", PLAN), **kw)
    if not fut.done():
        return None
    reply = fut.value()
    assert isinstance(reply, LeaseReply), reply
    return reply


def test_plan_batches_cover_the_samples_once() -> None:
    batches = PLAN.batches(0)
    assert [len(b) for b in batches] == [4] * 5 and sorted(i for b in batches for i in b) == list(range(20))
    assert PLAN.batches(1) != batches  # a new permutation per epoch
    assert DataPlan(10, 4, drop_last=True, shuffle=False).batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert DataPlan(10, 4).num_batches == 3
    with pytest.raises(ValueError, match="batch_size=0"):
        DataPlan(10, 0)


def test_leases_shrink_as_the_queue_drains_and_cover_the_epoch_once() -> None:
    c = AsyncCoordinator(2, None)
    plan = DataPlan(40, 1, shuffle=False)
    sizes, got = [], []
    while (reply := _refill(c, 0, 8, plan=plan)) is not None and not reply.over:
        sizes.append(len(reply.batches))
        got += [b.index for b in reply.batches]
    # guided: at most half of an equal share of what is left (ceil(left / (2 x 2 workers))), and one
    # batch is kept for worker 1, which has not drawn yet
    assert sizes == [8, 8, 6, 5, 3, 3, 2, 1, 1, 1, 1]
    last = _refill(c, 1, 8, plan=plan)
    assert last is not None and [b.index for b in last.batches] == [39] and sorted(got) == list(range(39))
    assert c.served(0) == [39, 1] and c.remaining(0) == 0
    end = _refill(c, 1, 8, plan=plan)
    assert end is not None and end.over and end.batches == []


def test_queue_keeps_a_batch_for_a_worker_that_has_not_drawn() -> None:
    c = AsyncCoordinator(3, None)
    taken = []
    while (reply := _refill(c, 0, 1)) is not None and not reply.over:
        taken += reply.batches
    assert len(taken) == 3  # 5 batches, 3 workers: the last two are kept for workers 1 and 2
    assert len(_refill(c, 2, 4).batches) == 1 and len(_refill(c, 1, 4).batches) == 1  # type: ignore[union-attr]
    assert c.served(0) == [3, 1, 1]


def test_credit_leases_no_more_than_the_bound_lets_a_worker_train() -> None:
    # s = 1, worker 1 at clock 0: worker 0 (clock 0) may start steps 1 and 2, i.e. hold 2 batches
    c = AsyncCoordinator(2, 1, timeout=timedelta(seconds=30))
    plan = DataPlan(100, 1)
    first = _refill(c, 0, 8, plan=plan)
    assert first is not None and len(first.batches) == 2
    assert all(b.admitted_min == 0 for b in first.batches)
    held = c.refill(0, 0, 8, clock=1, acks=[(0, first.batches[0].index)], plan=plan)  # 1 pushed, 1 held
    assert not held.done() and c.held_refills == [1, 0]
    c.report(1, 1)  # worker 1 pushes its first step: worker 0 may train up to clock 3
    reply = held.wait()
    assert isinstance(reply, LeaseReply) and len(reply.batches) == 1 and reply.waited > 0
    assert all(b.admitted_min == 1 for b in reply.batches)
    # every lease kept the worker's steps within s of the other's clock at the time
    assert all(clock - low <= 1 for _, clock, low in c.admissions)
    assert list(c.clock_log) == [(1, 0), (1, 1)]


def test_push_every_counts_clocks_in_pushes() -> None:
    # s = 0, k = 2: a clock is 2 batches, so worker 0 may hold 2 batches ahead of worker 1
    c = AsyncCoordinator(2, 0, push_every=2)
    reply = _refill(c, 0, 8, plan=DataPlan(100, 1))
    assert reply is not None and len(reply.batches) == 2


def test_zero_staleness_is_a_bulk_synchronous_schedule() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(100, 1)
    assert len(_refill(c, 0, 4, plan=plan).batches) == 1  # type: ignore[union-attr]
    held = c.refill(0, 0, 4, clock=1, acks=[(0, 0)], plan=plan)
    assert not held.done()
    assert _refill(c, 1, 4, plan=plan) is not None
    c.report(1, 1)
    assert held.done()


def test_held_refill_times_out_naming_the_missing_worker() -> None:
    c = AsyncCoordinator(3, 0, timeout=timedelta(seconds=0.2))
    plan = DataPlan(100, 1)
    _refill(c, 0, 1, plan=plan)
    error = c.refill(0, 0, 1, clock=1, plan=plan).wait()
    assert isinstance(error, ShardError) and error.timed_out
    assert "worker 0 (clock 1) waited 0s for worker(s) [1, 2]" in error.message
    assert "raise the strategy's `timeout`" in error.message
    c.shutdown()


def test_failed_worker_fails_the_held_refills_at_once() -> None:
    c = AsyncCoordinator(2, 0)
    plan = DataPlan(100, 1)
    _refill(c, 0, 1, plan=plan)
    fut = c.refill(0, 0, 1, clock=1, plan=plan)
    c.fail(1, "RuntimeError: boom")
    error = fut.wait()
    assert isinstance(error, ShardError) and "worker 1 failed: RuntimeError: boom" in error.message
    c.shutdown()


def test_workers_must_agree_on_the_plan() -> None:
    c = AsyncCoordinator(2, None)
    _refill(c, 0, 1)
    result = c.refill(1, 0, 1, clock=0, plan=DataPlan(20, 5)).wait()
    assert isinstance(result, ShardError) and "make train_dataloader() identical on all ranks" in result.message


def test_a_clock_change_retries_only_the_refills_it_can_open() -> None:
    """No O(P^2) release: a report re-evaluates only the held refills whose needed clock it reaches
    (a heap keyed by that clock), not every held refill."""
    workers = 64
    c = AsyncCoordinator(workers, 8)  # loose at first, so the workers spread out: worker w at clock w % 5 + 1
    plan = DataPlan(10_000, 1)
    for w in range(1, workers):
        for clock in range(w % 5 + 1):
            reply = _refill(c, w, 1, clock=clock, plan=plan)
            assert reply is not None and len(reply.batches) == 1
            c.report(w, clock + 1, [(0, reply.batches[0].index)])
    c.max_staleness = 0  # now bulk-synchronous: every worker ahead of worker 0 (clock 0) is held
    held = [c.refill(w, 0, 1, clock=w % 5 + 1, plan=plan) for w in range(1, workers)]
    assert not any(f.done() for f in held)
    retried: list[int] = []
    original = c._held.retry

    def counting(pending: Any) -> Any:
        retried.append(pending.worker)
        return original(pending)

    c._held.retry = counting  # type: ignore[method-assign]
    c.report(0, 1)  # worker 0 reaches clock 1: only the workers at clock 1 get credit (they need 1)
    opened = sorted(w for w, f in zip(range(1, workers), held, strict=True) if f.done())
    assert opened == [w for w in range(1, workers) if w % 5 + 1 == 1]
    assert sorted(retried) == opened


# --------------------------------------------------------------------------------------------
# The bound against its definition, on random schedules
# --------------------------------------------------------------------------------------------


class _SimWorker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.local: deque[LeasedBatch] = deque()
        self.clock = 0  # actual pushes
        self.since_push = 0
        self.unacked: list[LeasedBatch] = []
        self.outbox: list[tuple[int, list[tuple[int, int]]]] = []  # reports sent, not yet delivered
        self.refill: Any = None
        self.gate: Any = None  # a step held at the gate: (future, batch)
        self.gated: LeasedBatch | None = None
        self.over = False
        self.finished = False


def _simulate(
    seed: int, workers: int, s: int | None, k: int, lease: int, epochs: int = 2
) -> tuple[AsyncCoordinator, list[list[int]], int, int]:
    """Drive ``workers`` through ``epochs`` at random, as the lease and Lightning do: refills in the
    background at half a lease, a step only once the next batch is drawn (Lightning fetches one
    ahead), the bound checked at the step (from the batch's lease, else at the gate), clock
    reports delivered late, and every worker at an epoch-end barrier (validation) before the next.

    Returns the coordinator, every trained batch per epoch, the steps and the gate round trips.
    Asserts the bound at every step, and that no schedule stalls."""
    rng = random.Random(seed)
    plan = DataPlan(60, 2)
    c = AsyncCoordinator(workers, s, push_every=k, timeout=timedelta(seconds=60))
    sims = [_SimWorker(r) for r in range(workers)]
    trained: list[list[int]] = [[] for _ in range(epochs)]
    steps = gates = 0
    reported = dict.fromkeys(range(workers), 0)  # the coordinator's view of each clock
    for epoch in range(epochs):
        for w in sims:
            w.over = w.finished = False
        while not all(w.finished for w in sims):
            actions = []
            for w in sims:
                if w.finished:
                    continue
                if w.gate is not None:
                    if w.gate.done():
                        actions.append(("open", w))
                elif w.local and (len(w.local) >= 2 or w.over):
                    actions.append(("step", w))
                elif w.over and not w.local and w.refill is None:
                    actions.append(("finish", w))
                if w.refill is None and not w.over and len(w.local) <= lease // 2:
                    actions.append(("refill", w))
                if w.outbox:
                    actions.append(("deliver", w))
                if w.refill is not None and w.refill.done():
                    actions.append(("answer", w))
            assert actions, f"deadlock: {[(w.rank, w.clock, len(w.local), w.over, w.gate) for w in sims]}"
            action, w = rng.choice(actions)
            if action == "step":
                batch = w.local.popleft()
                known = batch.admitted_min
                if s is not None and known is not None and known < w.clock - s:
                    # the old per-step gate, on the clocks the coordinator knows now
                    low = min((reported[v.rank] for v in sims if v is not w and not v.finished), default=None)
                    w.gate = c.gate(w.rank, w.clock)
                    assert w.gate.done() == (low is None or low >= w.clock - s), (seed, w.rank, w.clock, low)
                    w.gated = batch
                    gates += 1
                    continue
                steps += _train(w, batch, sims, s, trained, k)
            elif action == "open":
                reply = w.gate.wait()
                assert not isinstance(reply, ShardError), reply
                batch, w.gate, w.gated = w.gated, None, None
                assert batch is not None
                steps += _train(w, batch, sims, s, trained, k)
            elif action == "refill":
                want = lease - len(w.local)
                # as the lease does: a refill carries the acks of the reports still on their way too
                acks = [a for _, sent in w.outbox for a in sent]
                w.refill = c.refill(w.rank, epoch, want, clock=w.clock, acks=acks, plan=plan, prefetch=1)
                reported[w.rank] = max(reported[w.rank], w.clock)
            elif action == "answer":
                reply = w.refill.wait()
                assert isinstance(reply, LeaseReply), reply
                w.refill = None
                w.local.extend(reply.batches)
                w.over = w.over or reply.over
            elif action == "deliver":
                clock, acks = w.outbox.pop(0)
                c.report(w.rank, clock, acks)
                reported[w.rank] = max(reported[w.rank], clock)
            else:  # finish: the epoch's last push (the flush), then the clock reaches the coordinator
                if w.since_push:
                    _push(w)
                for clock, acks in w.outbox:
                    c.report(w.rank, clock, acks)
                w.outbox = []
                c.report(w.rank, w.clock, [], finished=True)
                reported[w.rank] = w.clock
                w.finished = True
    return c, trained, steps, gates


def _train(
    w: _SimWorker, batch: LeasedBatch, sims: list[_SimWorker], s: int | None, trained: list[list[int]], k: int
) -> int:
    if s is not None:
        # the definition: starting step clock+1 needs every other worker still training the epoch
        # to have pushed clock - s times (one that finished it no longer holds the others back)
        others = [v.clock for v in sims if v is not w and not v.finished]
        assert not others or w.clock - min(others) <= s, (w.rank, w.clock, others)
    trained[batch.epoch].append(batch.index)
    w.unacked.append(batch)
    w.since_push += 1
    if w.since_push == k:
        _push(w)
    return 1


def _push(w: _SimWorker) -> None:
    w.clock += 1
    w.since_push = 0
    acks = [(b.epoch, b.index) for b in w.unacked]
    w.unacked = []
    w.outbox.append((w.clock, acks))  # delivered later, in order


def _cases() -> Iterator[tuple[int, int, int | None, int, int]]:
    for seed in range(6):
        for workers, s, k, lease in ((2, 0, 1, 2), (3, 1, 1, 4), (3, 0, 2, 4), (4, 2, 1, 2), (5, None, 1, 4)):
            yield seed, workers, s, k, lease


@pytest.mark.parametrize(("seed", "workers", "s", "k", "lease"), list(_cases()))
def test_random_schedules_keep_the_bound_cover_each_batch_once_and_never_stall(
    seed: int, workers: int, s: int | None, k: int, lease: int
) -> None:
    c, trained, steps, gates = _simulate(seed, workers, s, k, lease)
    for epoch, indices in enumerate(trained):
        assert sorted(indices) == list(range(30)), epoch
    assert steps == 60
    assert (gates == 0) == (s is None)  # no bound: no gate round trip at all
    # every batch acked, each counted once: the accounting of the epoch is complete
    for epoch in range(2):
        done = c.accounting(epoch)["done"]
        assert sorted(done) == list(range(30))


# --------------------------------------------------------------------------------------------
# Membership: drops, redraws, joins, the chief's epochs
# --------------------------------------------------------------------------------------------


def _elastic(workers: tuple[int, ...] = (1, 2, 3), s: int | None = None) -> AsyncCoordinator:
    c = AsyncCoordinator(list(workers), s, elastic=True, timeout=timedelta(seconds=30))
    c.open_epoch(0, DataPlan(24, 2, shuffle=False))
    return c


def test_a_dropped_workers_batches_are_redrawn_and_counted_once() -> None:
    c = _elastic()
    a = _refill(c, 1, 8)
    b = _refill(c, 2, 8)
    # guided leases: 12 batches for 3 workers, at most ceil(12 / 6) = 2, then ceil(10 / 6) = 2
    assert a is not None and b is not None and len(a.batches) == len(b.batches) == 2
    b.batches.extend(_refill(c, 2, 8).batches)  # type: ignore[union-attr]
    assert len(b.batches) == 4  # and ceil(8 / 6) = 2 more
    # worker 2 pushes one batch, then dies holding the other three
    c.report(2, 1, [(0, b.batches[0].index)])
    assert c.drop(2, "no heartbeat")
    assert c.batches_redrawn == 3 and c.workers_lost == 1 and c.alive == [1, 3]
    again = _refill(c, 3, 8)
    assert again is not None
    # the lost batches go to the front of the queue: leased next (guided: ceil(9 / 4) = 3 of them)
    assert [x.index for x in again.batches] == sorted(x.index for x in b.batches[1:])
    # a late ack of a redrawn batch from the dropped worker changes nothing; its refill is refused
    c.report(2, 2, [(0, b.batches[1].index)], incarnation=0)
    refused = c.refill(2, 0, 1, clock=2, plan=PLAN).wait()
    assert isinstance(refused, ShardError) and "was dropped from the run" in refused.message
    done = c.accounting(0)["done"]
    assert done == {b.batches[0].index: 2}
    assert sorted(c.accounting(0)["redrawn"]) == sorted(x.index for x in b.batches[1:])


def test_over_while_holding_batches_then_wait_for_redraws_or_the_next_epoch() -> None:
    c = _elastic((1, 2))
    taken: list[LeasedBatch] = []
    while (reply := _refill(c, 1, 4)) is not None and not reply.over:
        taken += reply.batches
    assert len(taken) == 12  # nobody else drew: worker 1 takes the whole epoch
    # no work left and worker 1 still holds 6 unpushed batches: "over" (its loop draws one ahead of
    # its step, so it could not finish them while a refill waits)
    assert _refill(c, 1, 4, clock=6, acks=[(b.epoch, b.index) for b in taken[:6]]).over  # type: ignore[union-attr]
    assert c.done_count(0) == 6
    w2 = c.refill(2, 1, 4, clock=0, plan=PLAN)  # worker 2 holds nothing: it waits for work
    assert not w2.done()
    held = c.refill(1, 2, 4, clock=7, acks=[(0, taken[6].index)], plan=PLAN)
    assert held.done()  # worker 1 still holds 5: over again, its next loop epoch starts
    c.drop(1, "SIGKILL")  # lost with 5 batches unpushed: worker 2's held refill gets them
    reply2 = w2.wait()
    assert isinstance(reply2, LeaseReply) and len(reply2.batches) == 3  # guided: ceil(5 / (2 x 1 alive))
    assert [b.index for b in reply2.batches] == [b.index for b in taken[7:10]]
    assert c.batches_redrawn == 5
    # the chief opens the next epoch only once every batch is pushed
    rest = _refill(c, 2, 4, clock=3, acks=[(b.epoch, b.index) for b in reply2.batches])
    assert rest is not None and len(rest.batches) == 1  # ceil(2 / 2)
    last = _refill(c, 2, 4, clock=4, acks=[(b.epoch, b.index) for b in rest.batches])
    assert last is not None and len(last.batches) == 1
    final = c.refill(2, 3, 4, clock=5, acks=[(b.epoch, b.index) for b in last.batches], plan=PLAN)
    assert not final.done() and c.done_count(0) == 12 and c.accounting(0)["done"][taken[0].index] == 1
    c.open_epoch(1, DataPlan(24, 2, shuffle=False))
    answer = final.wait()
    assert isinstance(answer, LeaseReply) and answer.batches and answer.batches[0].epoch == 1
    assert c.current_epoch == 1


def test_a_joined_worker_starts_at_the_others_lowest_clock() -> None:
    c = _elastic((1, 2), s=1)
    c.report(1, 5)
    c.report(2, 7)
    c.drop(2, "SIGKILL")
    joined = c.join(2, 1, "ps_worker2_1")
    assert joined.offset == 5 and joined.epoch == 0 and c.workers_joined == 1
    # worker 1 is not held back by the newcomer's clock 0: its credit counts the newcomer at 5
    reply = _refill(c, 1, 8, clock=5)
    assert reply is not None and len(reply.batches) == 2  # (5 + 1 + 1 - 5) x 1 - 0
    mine = _refill(c, 2, 8, clock=0, incarnation=1)
    assert mine is not None and mine.offset == 5 and mine.batches and mine.batches[0].admitted_min == 5


def test_wait_done_and_close() -> None:
    c = _elastic((1,))
    batches: list[LeasedBatch] = []
    while (reply := _refill(c, 1, 100)) is not None and not reply.over:
        batches += reply.batches
    assert len(batches) == 12
    done = threading.Event()
    counted: list[int] = []

    def chief() -> None:
        counted.append(c.wait_done(0, 12, timeout=10))
        done.set()

    thread = threading.Thread(target=chief, daemon=True)
    thread.start()
    c.report(1, 1, [(b.epoch, b.index) for b in batches[:6]])
    assert not done.wait(0.3) and c.done_count(0) == 6
    held = c.refill(1, 1, 4, clock=2, acks=[(b.epoch, b.index) for b in batches[6:]], plan=PLAN)
    thread.join(5)
    assert counted == [12] and not held.done()  # the epoch is complete; the next is not open yet
    c.close()
    stop = held.wait()
    assert isinstance(stop, LeaseReply) and stop.stop


def test_wait_done_fails_when_every_worker_is_gone() -> None:
    c = _elastic((1,))
    c.drop(1, "SIGKILL")
    with pytest.raises(TimeoutError, match=r"every worker is gone \(\[1\] lost or finished\) and none joined"):
        c.wait_done(0, 1, timeout=0.3)


# --------------------------------------------------------------------------------------------
# The worker's lease (rank 0, the coordinator in the same process)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def hosted() -> Iterator[AsyncCoordinator]:
    c = AsyncCoordinator(2, 1, timeout=timedelta(seconds=30))
    register_coordinator(c)
    yield c
    unregister_coordinator()
    c.shutdown()


def test_lease_refills_at_half_reports_each_push_and_gates_the_step(hosted: AsyncCoordinator) -> None:
    lease = BatchLease(0, rpc_timeout=5.0, lease=4, max_staleness=1)  # Lightning's one batch drawn ahead
    plan = DataPlan(100, 1)
    first = lease.next(0, plan)
    # s = 1 and worker 1 at clock 0: worker 0 may start steps 1 and 2, plus the one drawn ahead; the
    # refill at half a lease (after taking one) finds no credit left and waits
    assert first is not None and hosted.served(0) == [3, 0]
    assert lease.refills == 2 and hosted.held_refills == [1, 0]
    assert lease.admit(first, 0) == 0  # clock 0, the other's 0: admitted by the lease itself
    second = lease.next(0, plan)
    assert second is not None
    lease.pushed(1, [first])
    assert hosted.clocks == [1, 0] and hosted.done_count(0) == 1  # the report went at once
    assert lease.admit(second, 1) == 1
    third = lease.next(0, plan)
    assert third is not None
    lease.pushed(2, [second])
    # clock 2 is 2 ahead of worker 1: the step waits at the gate until worker 1 pushes
    threading.Timer(0.3, hosted.report, args=(1, 1)).start()
    assert lease.admit(third, 2) == 1 and lease.gate_seconds > 0.2 and lease.take_held()
    assert hosted.held_refills == [2, 0]  # the refill, then the gate
    fourth = lease.next(0, plan)  # the refill, answered by worker 1's push too
    assert fourth is not None and fourth.admitted_min == 1
    lease.pushed(3, [third])
    lease.flush()
    assert hosted.clocks == [3, 1] and hosted.done_count(0) == 3
    assert [(c, low) for c, low in lease.admissions] == [(0, 0), (1, 0), (2, 1)]


def test_lease_ends_the_epoch_when_the_queue_is_empty(hosted: AsyncCoordinator) -> None:
    lease = BatchLease(0, rpc_timeout=5.0, lease=8)
    plan = DataPlan(6, 2, shuffle=False)
    hosted.max_staleness = None
    got = []
    while (batch := lease.next(0, plan)) is not None:
        got.append(batch.index)
    assert got == [0, 1]  # the third is kept for worker 1, which has not drawn
    assert lease.next(1, plan) is not None  # a new epoch starts afresh


def test_lease_limit_and_stop_polling(hosted: AsyncCoordinator) -> None:
    lease = BatchLease(0, rpc_timeout=5.0, lease=8)
    plan = DataPlan(100, 1)
    hosted.max_staleness = None
    assert [lease.next(0, plan, limit=3) is not None for _ in range(4)] == [True, True, True, False]
    assert hosted.served(0) == [3, 0]  # no batch leased beyond the limit
    hosted.max_staleness = 0
    lease.prefetch = 0
    lease.pushed(1, [])
    lease.flush(finished=False)  # clock 1 with 3 batches unpushed: no credit left at s = 0
    with pytest.raises(RuntimeError, match="told to stop while waiting for a lease of epoch 1"):
        lease.next(1, plan, should_stop=lambda: True)


def test_given_back_batches_go_to_the_front_and_are_not_counted_as_redrawn() -> None:
    c = _elastic((1, 2))
    reply = _refill(c, 1, 8)
    assert reply is not None and len(reply.batches) == 3  # guided: ceil(12 / (2 x 2))
    c.report(1, 1, [(0, reply.batches[0].index)], returned=[(0, b.index) for b in reply.batches[1:]])
    assert c.batches_returned == 2 and c.batches_redrawn == 0
    again = _refill(c, 2, 8)
    assert again is not None and [b.index for b in again.batches[:2]] == [b.index for b in reply.batches[1:]]


# --------------------------------------------------------------------------------------------
# Membership monitor (on the chief): a reported failure, a worker that never joined
# --------------------------------------------------------------------------------------------


def test_monitor_drops_a_worker_that_reported_a_failure_or_never_joined() -> None:
    import torch.distributed as dist

    from lightning_strategies.comm.elastic import MembershipMonitor, member_id, member_name
    from lightning_strategies.comm.heartbeat import Heartbeat

    store = dist.HashStore()
    chief = Heartbeat(store, 0, 3)
    failing = Heartbeat(store, 1, 3).start()
    failing.report_failure("RuntimeError: out of memory")
    dropped: list[tuple[int, str]] = []
    monitor = MembershipMonitor(
        chief,
        workers=[1, 2],
        servers=[],
        name_of=lambda r: f"w{r}",
        alive=lambda: [r for r in (1, 2) if r not in {d for d, _ in dropped}],
        joined=lambda r: r == 1,  # worker 2 never joined
        drop=lambda r, why: dropped.append((r, why)),
        fail=lambda r, why: None,
        timeout=timedelta(seconds=0.2),
    )
    monitor._poll()  # worker 2 is given until the timeout to join
    assert dropped == [(1, "it reported a failure (RuntimeError: out of memory)")]
    time.sleep(0.3)
    monitor._poll()
    assert dropped[1] == (2, "it did not join the run within the timeout (0 s)")
    assert [r for r, _, _ in monitor.events] == [1, 2]
    failing.stop(finished=False)
    # a relaunch gets a name and an id of its own; ids of the dead are not reused
    assert member_name(2, 0) == "ps_worker2" and member_name(2, 3) == "ps_worker2_3"
    assert member_id(2, 3, 4) == 14
    with pytest.raises(ValueError, match=r"its RPC id 32770 is past TensorPipe's 32767"):
        member_id(2, 8192, 4)


def test_a_late_report_that_a_worker_finished_the_last_epoch_keeps_it_in_the_bound_of_the_next() -> None:
    # s = 0, 2 workers, 2 batches an epoch: worker 1 finishes epoch 0 and opens epoch 1 before worker 0's
    # epoch-end report (that it finished epoch 0) arrives; worker 0 trains epoch 1 too, so it still holds
    # worker 1 to the bound there (it used to become inactive: worker 1 was then leased ungated batches)
    c = AsyncCoordinator(2, 0, timeout=timedelta(seconds=30))
    plan = DataPlan(8, 4, shuffle=False)
    mine = [_refill(c, w, 4, plan=plan) for w in (0, 1)]
    assert all(r is not None and len(r.batches) == 1 for r in mine)
    c.report(0, 1, [(0, mine[0].batches[0].index)])  # type: ignore[union-attr]
    c.report(1, 1, [(0, mine[1].batches[0].index)], finished=True)  # type: ignore[union-attr]
    first = _refill(c, 1, 4, clock=1, epoch=1, plan=plan)  # opens epoch 1
    assert first is not None and [b.admitted_min for b in first.batches] == [1]
    c.report(0, 1, [], finished=True)  # worker 0's flush of epoch 0, late
    c.report(1, 2, [(1, first.batches[0].index)])
    gate = c.gate(1, 2)  # worker 1's next step (clock 2) needs worker 0's second push
    assert not gate.done()
    c.report(0, 2)
    reply = gate.wait()
    assert not isinstance(reply, ShardError) and reply.min_other == 2


def test_a_worker_out_of_its_epochs_batches_frees_the_others_while_one_is_kept_for_a_late_worker() -> None:
    # s = 0, 2 batches: worker 0 trains one, the other is kept for worker 1, which has not drawn yet;
    # worker 0's epoch is over, so it must not hold worker 1 to the bound while that one catches up
    c = AsyncCoordinator(2, 0, timeout=timedelta(seconds=30))
    plan = DataPlan(8, 4, shuffle=False)
    first = _refill(c, 0, 4, plan=plan)
    assert first is not None and len(first.batches) == 1
    over = _refill(c, 0, 4, clock=1, acks=[(0, first.batches[0].index)], plan=plan)
    assert over is not None and over.over and not over.batches
    c.report(0, 1, [], finished=True)
    assert list(c.clock_log)[-1] == (-1, 0)
    gate = c.gate(1, 3)  # nobody left to wait for in this epoch
    assert gate.done()
