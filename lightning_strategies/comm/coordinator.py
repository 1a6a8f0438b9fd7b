"""The async coordinator: workers' clocks, the stale-synchronous gate and the epoch's data queue.

Hosted by rank 0 of an ``"async"`` run, with no Lightning import. A worker asks it for its next
batch of indices at the start of each step (:func:`draw_batch`); the answer is the
stale-synchronous-parallel (SSP) gate: it is given only once every other worker has pushed at
least ``clock - max_staleness`` times (Ho et al. 2013), so no worker starts step ``c+1`` before
every worker has pushed step ``c - s``. Gating the *draw* rather than the push keeps the epoch
end free of deadlocks: a worker that would be too far ahead takes no batch, while the slowest
worker is never gated and, whenever a faster one waits for it, already holds the batch of its
next step (a worker takes a batch only after the slowest one took its own, and the queue keeps
one batch for every worker that has not drawn in the epoch yet, so every rank trains in every
epoch).

Clocks travel with every draw and with a fire-and-forget tick after every push
(:func:`send_tick`); the gate uses the larger, so a lost ordering between the two RPCs never
lowers a clock. A failing worker tells the coordinator (:func:`report_failure`), so no draw
waits for its clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from lightning_strategies.comm.rpc import (
    ShardError,
    call_host,
    hosted_coordinator,
    local_coordinator,
    wait_reply,
)

__all__ = [
    "RECORD_LIMIT",
    "AsyncCoordinator",
    "DataPlan",
    "Draw",
    "draw_batch",
    "report_failure",
    "send_tick",
]

# Records kept for inspection (tests, logs), bounded so that a long run's memory stays flat:
# about 1.3 MB per kind at this size, far more than any test or report reads.
RECORD_LIMIT = 10_000


@dataclass(frozen=True)
class DataPlan:
    """How an epoch's samples become batches; every worker must send the same plan.

    Attributes:
        num_samples: samples in the training set.
        batch_size: indices per batch.
        drop_last: drop the last batch when it is short (as ``DataLoader(drop_last=True)``).
        shuffle: a fresh permutation every epoch (seeded by ``seed + epoch``), else in order.
        seed: base seed of the permutation.
    """

    num_samples: int
    batch_size: int
    drop_last: bool = False
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 0 or self.batch_size < 1:
            raise ValueError(
                f"DataPlan(num_samples={self.num_samples}, batch_size={self.batch_size}): expected "
                "num_samples >= 0 and batch_size >= 1"
            )

    @property
    def num_batches(self) -> int:
        """Batches in one epoch over all workers."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's batches, in the order the queue hands them out."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        ids = order.tolist()
        return [ids[i : i + self.batch_size] for i in range(0, self.batch_size * self.num_batches, self.batch_size)]


@dataclass
class Draw:
    """The coordinator's answer to one draw.

    Attributes:
        indices: the batch's sample indices, or ``None`` when the epoch's queue is empty.
        waited: seconds the draw was held by the staleness gate.
        blocked: the gate held the draw (so slower workers pushed meanwhile).
    """

    indices: list[int] | None
    waited: float = 0.0
    blocked: bool = False


@dataclass
class _PendingDraw:
    worker: int
    epoch: int
    clock: int
    start: float
    future: Future[Draw | ShardError]
    ahead: bool = False
    gated: bool = True
    timer: threading.Timer | None = None


@dataclass
class _Epoch:
    plan: DataPlan
    queue: deque[list[int]]
    served: list[int] = field(default_factory=list)


class AsyncCoordinator:
    """Workers' clocks, the stale-synchronous gate, and one shared data queue per epoch.

    Args:
        num_workers: training processes.
        max_staleness: the SSP bound ``s``; ``None`` for no bound (no draw ever waits).
        timeout: how long a gated draw waits for the slow workers before failing with an error
            that names them.
    """

    def __init__(
        self, num_workers: int, max_staleness: int | None, *, timeout: timedelta = timedelta(minutes=30)
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, found {num_workers}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, found {max_staleness}")
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.clocks = [0] * num_workers
        self._lock = threading.Lock()
        self._epochs: dict[int, _Epoch] = {}
        self._pending: list[_PendingDraw] = []
        self._failure: str | None = None
        # (worker, its clock, the lowest clock of the others) at every batch handed out
        self.admissions: deque[tuple[int, int, int]] = deque(maxlen=RECORD_LIMIT)
        # every worker's clock after each change
        self.clock_log: deque[tuple[int, ...]] = deque(maxlen=RECORD_LIMIT)
        self.wait_seconds = [0.0] * num_workers
        self.blocked_draws = [0] * num_workers

    # -- clocks -----------------------------------------------------------------------------

    def tick(self, worker: int, clock: int) -> None:
        """Worker ``worker`` has pushed ``clock`` times; open the draws this allows."""
        with self._lock:
            ready = self._advance_clock(worker, clock)
        self._deliver(ready)

    def _advance_clock(self, worker: int, clock: int) -> list[tuple[_PendingDraw, Draw]]:
        if clock > self.clocks[worker]:
            self.clocks[worker] = clock
            self.clock_log.append(tuple(self.clocks))
            return self._release_pending()
        return []

    def _allowed(self, worker: int, clock: int) -> bool:
        if self.max_staleness is None or self.num_workers == 1:
            return True
        return self._min_other(worker) >= clock - self.max_staleness

    def _min_other(self, worker: int) -> int:
        others = [c for w, c in enumerate(self.clocks) if w != worker]
        return min(others) if others else self.clocks[worker]

    # -- the queue --------------------------------------------------------------------------

    def draw(
        self, worker: int, epoch: int, clock: int, plan: DataPlan, *, ahead: bool = False
    ) -> Future[Draw | ShardError]:
        """The next batch of epoch ``epoch`` for ``worker`` (whose clock is ``clock``).

        The future completes at once when the gate allows (or the epoch's queue is empty),
        else when the slow workers' pushes open the gate, or with an error after ``timeout``.

        Every worker gets at least one batch per epoch when the epoch has as many batches as
        workers: the last batches are kept for workers that have not drawn yet. (A training
        loop that sees no batch skips the epoch-end validation its peers run, and their
        collectives would never match.)

        Args:
            worker: the drawing worker.
            epoch: the epoch; its queue is built from ``plan`` by the first worker to draw.
            clock: the worker's pushes so far; the draw waits until every other worker has
                pushed ``clock - max_staleness`` times.
            plan: how the epoch is batched; every worker must send the same.
            ahead: the worker's loop fetches one batch ahead (Lightning does when the loader
                has no length), so the draw at the start of step ``k`` fetches batch ``k+1``.
                Then the epoch's first draw comes before any step and is not gated, and the
                "no more batches" answer comes at the start of the last step and is gated.
                Without ``ahead`` every draw that hands out a batch starts a step and is gated,
                and "no more batches" starts none and is answered at once.
        """
        fut: Future[Draw | ShardError] = Future()
        ready: list[tuple[_PendingDraw, Draw]] = []
        with self._lock:
            error = self._check_draw(worker, epoch, plan)
            if error is not None:
                fut.set_result(ShardError(error))
                return fut
            ready = self._advance_clock(worker, clock)
            first = self._epochs[epoch].served[worker] == 0
            pending = _PendingDraw(worker, epoch, clock, time.perf_counter(), fut, ahead, not (ahead and first))
            answer = self._answer_if_allowed(pending)
            if answer is not None:
                ready.append((pending, answer))
            else:
                self.blocked_draws[worker] += 1
                pending.timer = threading.Timer(self.timeout.total_seconds(), self._expire, args=(pending,))
                pending.timer.daemon = True
                pending.timer.start()
                self._pending.append(pending)
        self._deliver(ready)
        return fut

    def _check_draw(self, worker: int, epoch: int, plan: DataPlan) -> str | None:
        if self._failure is not None:
            return f"the async coordinator has failed earlier: {self._failure}"
        if not 0 <= worker < self.num_workers:
            return f"async coordinator: draw from worker {worker}, expected a worker in [0, {self.num_workers})"
        known = self._epochs.get(epoch)
        if known is None:
            self._epochs[epoch] = _Epoch(plan, deque(plan.batches(epoch)), [0] * self.num_workers)
            for old in [e for e in self._epochs if e < epoch - 2]:
                del self._epochs[old]  # keep the last few epochs' counts for inspection
        elif known.plan != plan:
            return (
                f"async coordinator: worker {worker} drew epoch {epoch} with {plan}, but another worker drew it "
                f"with {known.plan}. Expected every rank to build the same training DataLoader (dataset size, "
                "batch size, drop_last, shuffle, seed). Fix: make train_dataloader() identical on all ranks."
            )
        return None

    def _answer_if_allowed(self, pending: _PendingDraw) -> Draw | None:
        """The answer to ``pending`` if it can be given now (holding the lock)."""
        epoch = self._epochs.get(pending.epoch)
        blocked = pending.timer is not None  # it had to wait in the queue of pending draws
        waited = time.perf_counter() - pending.start if blocked else 0.0
        if epoch is None:
            return Draw(None, waited, blocked)
        first = epoch.served[pending.worker] == 0
        # batches kept for the workers that have not drawn this epoch yet
        reserved = 0 if first else sum(1 for n in epoch.served if n == 0)
        over = len(epoch.queue) <= reserved
        if over and not pending.ahead:
            return Draw(None, waited, blocked)  # starts no step: nothing to gate
        # fetching ahead, even "no more batches" comes at the start of a step (the last one)
        if pending.gated and not self._allowed(pending.worker, pending.clock):
            return None
        if pending.gated:
            self.admissions.append((pending.worker, pending.clock, self._min_other(pending.worker)))
        if over:
            return Draw(None, waited, blocked)
        epoch.served[pending.worker] += 1
        return Draw(epoch.queue.popleft(), waited, blocked)

    def _release_pending(self) -> list[tuple[_PendingDraw, Draw]]:
        ready = []
        for pending in list(self._pending):  # oldest first
            answer = self._answer_if_allowed(pending)
            if answer is not None:
                self._pending.remove(pending)
                if pending.timer is not None:
                    pending.timer.cancel()
                self.wait_seconds[pending.worker] += answer.waited
                ready.append((pending, answer))
        return ready

    @staticmethod
    def _deliver(ready: list[tuple[_PendingDraw, Draw]]) -> None:
        # outside the lock: a future's callbacks serialise the RPC reply inline
        for pending, answer in ready:
            pending.future.set_result(answer)

    def fail(self, worker: int, reason: str) -> None:
        """Worker ``worker`` failed: fail every waiting and every later draw, naming it.

        Without this a draw gated on the failed worker's clock would wait for the whole
        ``timeout``; the failing worker calls it (over RPC) before it shuts down.
        """
        with self._lock:
            if self._failure is None:
                self._failure = f"worker {worker} failed: {reason}"
            waiting = self._take_pending()
        self._fail_all(waiting, ShardError(self._failure))

    def _expire(self, pending: _PendingDraw) -> None:
        with self._lock:
            if pending not in self._pending:
                return
            assert self.max_staleness is not None
            need = pending.clock - self.max_staleness
            behind = {w: c for w, c in enumerate(self.clocks) if w != pending.worker and c < need}
            self._failure = (
                f"worker {pending.worker} (clock {pending.clock}) waited {self.timeout.total_seconds():.0f}s for "
                f"worker(s) {sorted(behind)} (clocks {list(behind.values())}) to push step {need} "
                f"(max_staleness={self.max_staleness}). Worker(s) {sorted(behind)} died or are stuck; check their "
                "logs. To wait longer for slow workers, raise the strategy's `timeout`."
            )
            waiting = self._take_pending()
        self._fail_all(waiting, ShardError(self._failure, timed_out=True))

    def _take_pending(self) -> list[_PendingDraw]:
        """Every waiting draw, removed from the queue (holding the lock)."""
        waiting = list(self._pending)
        self._pending.clear()
        return waiting

    @staticmethod
    def _fail_all(waiting: list[_PendingDraw], error: ShardError) -> None:
        # outside the lock, as in _deliver
        for pending in waiting:
            if pending.timer is not None:
                pending.timer.cancel()
            pending.future.set_result(error)

    # -- inspection -------------------------------------------------------------------------

    def served(self, epoch: int) -> list[int]:
        """Batches handed to each worker in epoch ``epoch`` (zeros when unknown)."""
        with self._lock:
            known = self._epochs.get(epoch)
            return list(known.served) if known is not None else [0] * self.num_workers

    def remaining(self, epoch: int) -> int:
        """Batches of epoch ``epoch`` not handed out yet."""
        with self._lock:
            known = self._epochs.get(epoch)
            return len(known.queue) if known is not None else 0


def _coordinator_is_local(worker: int, coordinator_rank: int) -> bool:
    return worker == coordinator_rank and local_coordinator() is not None


@rpc.functions.async_execution
def _rpc_draw(worker: int, epoch: int, clock: int, plan: DataPlan, ahead: bool) -> Future[Draw | ShardError]:
    # returns the gate's future at once: the RPC thread is free while the draw waits
    return hosted_coordinator().draw(worker, epoch, clock, plan, ahead=ahead)


def _rpc_tick(worker: int, clock: int) -> None:
    # a last tick may arrive after the coordinator's teardown: the clocks no longer matter then
    coordinator = local_coordinator()
    if coordinator is not None:
        coordinator.tick(worker, clock)


def _rpc_fail(worker: int, reason: str) -> None:
    hosted_coordinator().fail(worker, reason)


def send_tick(worker: int, clock: int, *, coordinator_rank: int, rpc_timeout: float) -> Future[None]:
    """Tell the coordinator that ``worker`` has pushed ``clock`` times, without waiting for it.

    Returns:
        The future of the coordinator's acknowledgement (it fails when the coordinator is gone).
    """
    local = _coordinator_is_local(worker, coordinator_rank)
    return call_host(coordinator_rank, _rpc_tick, worker, clock, local=local, timeout=rpc_timeout)


def report_failure(worker: int, reason: str, *, coordinator_rank: int = 0, timeout_s: float = 2.0) -> None:
    """Tell the coordinator that ``worker`` failed, so draws waiting on its clock fail at once.

    Best effort and bounded: the coordinator's host may be gone too.
    """
    local = _coordinator_is_local(worker, coordinator_rank)
    with contextlib.suppress(Exception):  # the coordinator's own timeout still bounds every wait
        call_host(coordinator_rank, _rpc_fail, worker, reason, local=local, timeout=timeout_s).wait()


def draw_batch(
    worker: int,
    epoch: int,
    clock: int,
    plan: DataPlan,
    *,
    coordinator_rank: int,
    rpc_timeout: float,
    ahead: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Draw:
    """Ask the coordinator for worker ``worker``'s next batch (the gate applies to ``clock``).

    A free function so a data loader can draw before the worker's client exists (Lightning
    builds and iterates the training loader while the optimizers are being configured).

    ``should_stop`` is polled while the gate holds the draw, so that a process told to stop
    (SIGTERM from a launcher whose other rank died) does not sit out the whole timeout.

    Raises:
        RuntimeError / TimeoutError: naming the workers the gate waited for, or the failure.
    """
    local = _coordinator_is_local(worker, coordinator_rank)
    fut = call_host(coordinator_rank, _rpc_draw, worker, epoch, clock, plan, ahead, local=local, timeout=rpc_timeout)
    where = (
        f"worker {worker}: drawing a batch of epoch {epoch} at clock {clock} from the async coordinator (rank "
        f"{coordinator_rank}) failed"
    )
    if should_stop is not None:
        answered = threading.Event()
        fut.add_done_callback(lambda _: answered.set())
        while not answered.wait(0.25):
            if should_stop():
                raise RuntimeError(f"{where}: told to stop while the staleness gate held the draw")
    draw: Draw = wait_reply(fut, where)
    return draw
