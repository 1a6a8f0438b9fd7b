"""Asynchronous parameter servers: shards that apply each push at once, a clock gate, a data queue.

Built on :mod:`lightning_strategies.comm.ps` (the same sharding plan, optimizer rebuilt on the
shards, RPC registry and byte counting), with no Lightning import. Three pieces:

- :class:`AsyncParameterShard` applies every pushed gradient immediately with its optimizer (no
  barrier). It records each gradient's *staleness*: the updates this shard applied between the
  worker's last pull (the weights its gradient was computed on) and this push. With
  ``staleness_lr="inverse"`` it divides that gradient's learning rate by ``1 + staleness``
  (Zhang et al. 2016, "Staleness-aware async-SGD"). It also counts every worker's pushes.
- :class:`AsyncCoordinator`, hosted by rank 0, keeps the workers' *clocks* (pushes made) and
  the epoch's *data queue*. A worker asks it for its next batch of indices at the start of each
  step (:meth:`AsyncCoordinator.draw`); the answer is the stale-synchronous-parallel (SSP) gate:
  it is given only once every other worker has pushed at least ``clock - max_staleness`` times
  (Ho et al. 2013), so no worker starts step ``c+1`` before every worker has pushed step
  ``c - s``. Gating the *draw* rather than the push keeps the epoch end free of deadlocks: a
  worker that would be too far ahead takes no batch, while the slowest worker is never gated
  and, whenever a faster one waits for it, already holds the batch of its next step (a worker
  takes a batch only after the slowest one took its own, and the queue keeps one batch for
  every worker that has not drawn in the epoch yet, so every rank trains in every epoch).
- :class:`AsyncParameterServerClient`, the worker's side: push (optionally with a pull in the
  same round trip), pull, and draw.

Clocks travel with every draw and with a fire-and-forget tick after every push; the gate uses
the larger, so a lost ordering between the two RPCs never lowers a clock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    ShardError,
    _hosted,
    _nbytes,
    local_shard,
    worker_name,
)

__all__ = [
    "STALENESS_LR",
    "AsyncCoordinator",
    "AsyncParameterServerClient",
    "AsyncParameterShard",
    "AsyncReply",
    "DataPlan",
    "Draw",
    "StalenessLR",
    "draw_batch",
    "local_coordinator",
    "register_coordinator",
    "report_failure",
    "unregister_coordinator",
]

StalenessLR = Literal["none", "inverse"]
STALENESS_LR: tuple[str, ...] = ("none", "inverse")

# records kept for inspection (tests, logs); bounded so that long runs do not grow without end.
# A record is a small tuple, ~104 bytes with its deque slot (~128 for a clock tuple of 2 workers),
# and rank 0 keeps three kinds (its shard's pushes, the coordinator's admissions and clocks):
# at 200_000 each that was ~67 MB, which benchmarks/soak.py saw as steady RSS growth; 10_000
# caps them at ~3.4 MB, still far more than any test or report reads.
_RECORD_LIMIT = 10_000


# --------------------------------------------------------------------------------------------
# Shard
# --------------------------------------------------------------------------------------------


@dataclass
class AsyncReply:
    """A shard's answer to one asynchronous push or pull.

    Attributes:
        values: the shard's tensors after the push (copies), or ``None`` when not pulled.
        version: updates the shard has applied so far.
        staleness: the pushed gradient's staleness, or -1 for a pull alone.
        step_bytes: payload bytes of this exchange (gradients in plus values out).
    """

    values: list[Tensor] | None
    version: int
    staleness: int
    step_bytes: int


class AsyncParameterShard(ParameterShard):
    """A shard in asynchronous mode: each push is applied alone, as soon as it arrives.

    Args:
        shard_id: index of this shard (the rank that hosts it).
        flat_indices: the optimizer-order indices of the tensors held, sorted.
        params: those tensors' initial values (copied).
        spec: how to rebuild the worker's optimizer over them.
        num_workers: workers that push.
        staleness_lr: ``"inverse"`` divides a gradient's learning rate by ``1 + staleness``.
        timeout: kept for the base class's error messages (nothing here waits).
    """

    def __init__(
        self,
        shard_id: int,
        flat_indices: Sequence[int],
        params: Sequence[Tensor],
        spec: OptimizerSpec,
        num_workers: int,
        *,
        staleness_lr: StalenessLR = "none",
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        if staleness_lr not in STALENESS_LR:
            raise ValueError(
                f"staleness_lr={staleness_lr!r}: expected one of {list(STALENESS_LR)}; pass 'none' to use the "
                "worker's lr as is, or 'inverse' to divide it by 1 + staleness"
            )
        super().__init__(shard_id, flat_indices, params, spec, num_workers, barrier=False, timeout=timeout)
        self.staleness_lr = staleness_lr
        self.clocks = [0] * num_workers
        # the shard version each worker's weights came from (its last pull of this shard)
        self._pulled = [0] * num_workers
        self.staleness_sum = 0
        self.staleness_max = 0
        self.pushes = 0
        # (worker, worker's clock after the push, staleness), oldest first
        self.log: deque[tuple[int, int, int]] = deque(maxlen=_RECORD_LIMIT)

    def push_pull(
        self, worker: int, grads: list[Tensor | None], lrs: list[float], *, pull: bool
    ) -> AsyncReply | ShardError:
        """Apply ``grads`` now; answer with the new values when ``pull``.

        Runs under the shard's lock, on the RPC thread that received the push (or on the
        co-located worker's training thread); it never waits for another worker.
        """
        nbytes = _nbytes(grads)
        with self._lock:
            self.stats.bytes_received += nbytes
            self.stats.calls += 1
            error = self._check_push(worker, self.version, grads, lrs)
            if error is not None:
                return ShardError(error)
            staleness = self.version - self._pulled[worker]
            if self.staleness_lr == "inverse" and staleness:
                lrs = [lr / (1 + staleness) for lr in lrs]
            self._step([grads], lrs)
            self.clocks[worker] += 1
            self.pushes += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
            self.log.append((worker, self.clocks[worker], staleness))
            values, sent = self._snapshot(worker) if pull else (None, 0)
            return AsyncReply(values, self.version, staleness, nbytes + sent)

    def pull(self, worker: int) -> AsyncReply | ShardError:
        """The shard's current values (copies), remembered as worker ``worker``'s base version."""
        with self._lock:
            if not 0 <= worker < self.num_workers:
                return ShardError(
                    f"parameter server shard {self.shard_id}: pull from worker {worker}, expected "
                    f"a worker in [0, {self.num_workers})"
                )
            self.stats.calls += 1
            values, sent = self._snapshot(worker)
            return AsyncReply(values, self.version, -1, sent)

    def _snapshot(self, worker: int) -> tuple[list[Tensor], int]:
        # copies: the next push may update the tensors while this reply is being serialised
        self._pulled[worker] = self.version
        self.stats.bytes_sent += self._values_bytes
        return [p.detach().clone() for p in self.params], self._values_bytes


def _rpc_async_push(shard_id: int, worker: int, grads: list[Tensor | None], lrs: list[float], pull: bool) -> Any:
    shard = _hosted(shard_id)
    if not isinstance(shard, AsyncParameterShard):
        return ShardError(
            f"parameter server shard {shard_id} is synchronous; an asynchronous push needs an "
            "AsyncParameterShard (do all ranks use strategy='async'?)"
        )
    return shard.push_pull(worker, grads, lrs, pull=pull)


def _rpc_async_pull(shard_id: int, worker: int) -> Any:
    shard = _hosted(shard_id)
    if not isinstance(shard, AsyncParameterShard):
        return ShardError(f"parameter server shard {shard_id} is synchronous; expected an AsyncParameterShard")
    return shard.pull(worker)


# --------------------------------------------------------------------------------------------
# Coordinator: clocks, the SSP gate and the epoch's data queue
# --------------------------------------------------------------------------------------------


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
        self.admissions: deque[tuple[int, int, int]] = deque(maxlen=_RECORD_LIMIT)
        # every worker's clock after each change
        self.clock_log: deque[tuple[int, ...]] = deque(maxlen=_RECORD_LIMIT)
        self.wait_seconds = [0.0] * num_workers
        self.blocked_draws = [0] * num_workers

    # -- clocks -----------------------------------------------------------------------------

    def tick(self, worker: int, clock: int) -> None:
        """Worker ``worker`` has pushed ``clock`` times; open the draws this allows."""
        with self._lock:
            ready = self._advance(worker, clock)
        self._answer(ready)

    def _advance(self, worker: int, clock: int) -> list[tuple[_PendingDraw, Draw]]:
        if clock > self.clocks[worker]:
            self.clocks[worker] = clock
            self.clock_log.append(tuple(self.clocks))
            return self._release()
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
            ready = self._advance(worker, clock)
            first = self._epochs[epoch].served[worker] == 0
            pending = _PendingDraw(worker, epoch, clock, time.perf_counter(), fut, ahead, not (ahead and first))
            answer = self._try(pending)
            if answer is not None:
                ready.append((pending, answer))
            else:
                self.blocked_draws[worker] += 1
                pending.timer = threading.Timer(self.timeout.total_seconds(), self._expire, args=(pending,))
                pending.timer.daemon = True
                pending.timer.start()
                self._pending.append(pending)
        self._answer(ready)
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

    def _try(self, pending: _PendingDraw) -> Draw | None:
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

    def _release(self) -> list[tuple[_PendingDraw, Draw]]:
        ready = []
        for pending in list(self._pending):  # oldest first
            answer = self._try(pending)
            if answer is not None:
                self._pending.remove(pending)
                if pending.timer is not None:
                    pending.timer.cancel()
                self.wait_seconds[pending.worker] += answer.waited
                ready.append((pending, answer))
        return ready

    @staticmethod
    def _answer(ready: list[tuple[_PendingDraw, Draw]]) -> None:
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
            failed = list(self._pending)
            self._pending.clear()
        for p in failed:
            if p.timer is not None:
                p.timer.cancel()
            p.future.set_result(ShardError(self._failure))

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
            failed = list(self._pending)
            self._pending.clear()
        for p in failed:
            if p.timer is not None:
                p.timer.cancel()
            p.future.set_result(ShardError(self._failure, timed_out=True))

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


_COORDINATOR: list[AsyncCoordinator] = []


def register_coordinator(coordinator: AsyncCoordinator) -> None:
    """Make ``coordinator`` reachable by RPC in this process (rank 0 hosts it)."""
    _COORDINATOR[:] = [coordinator]


def unregister_coordinator() -> None:
    """Forget this process's coordinator (at teardown)."""
    _COORDINATOR.clear()


def local_coordinator() -> AsyncCoordinator | None:
    """The coordinator when this process hosts it."""
    return _COORDINATOR[0] if _COORDINATOR else None


def _hosted_coordinator() -> AsyncCoordinator:
    if not _COORDINATOR:
        raise RuntimeError(f"{rpc.get_worker_info().name} hosts no async coordinator; rank 0 should")
    return _COORDINATOR[0]


@rpc.functions.async_execution
def _rpc_draw(worker: int, epoch: int, clock: int, plan: DataPlan, ahead: bool) -> Future[Draw | ShardError]:
    # returns the gate's future at once: the RPC thread is free while the draw waits
    return _hosted_coordinator().draw(worker, epoch, clock, plan, ahead=ahead)


def _rpc_tick(worker: int, clock: int) -> None:
    # a last tick may arrive after the coordinator's teardown: the clocks no longer matter then
    coordinator = local_coordinator()
    if coordinator is not None:
        coordinator.tick(worker, clock)


def _rpc_fail(worker: int, reason: str) -> None:
    _hosted_coordinator().fail(worker, reason)


def report_failure(worker: int, reason: str, *, coordinator_rank: int = 0, timeout_s: float = 2.0) -> None:
    """Tell the coordinator that ``worker`` failed, so draws waiting on its clock fail at once.

    Best effort and bounded: the coordinator's host may be gone too.
    """
    coordinator = local_coordinator() if worker == coordinator_rank else None
    try:
        if coordinator is not None:
            coordinator.fail(worker, reason)
        else:
            rpc.rpc_async(worker_name(coordinator_rank), _rpc_fail, args=(worker, reason), timeout=timeout_s).wait()
    except Exception:
        pass  # the coordinator's own timeout still bounds every wait


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class AsyncParameterServerClient(ParameterServerClient):
    """A worker's handle on the asynchronous shards and on the coordinator (rank 0).

    ``step`` of the base class is this worker's clock: the pushes it has made.

    Args:
        worker: this worker's index (its global rank).
        params: the worker's trainable tensors in the optimizer's flat order.
        plan: :func:`~lightning_strategies.comm.ps.shard_parameters`'s output.
        timeout: bound on a gated draw; the RPC timeout is a little longer.
        coordinator_rank: the rank hosting the :class:`AsyncCoordinator`.
    """

    def __init__(
        self,
        worker: int,
        params: Sequence[Tensor],
        plan: Sequence[Sequence[int]],
        *,
        timeout: timedelta = timedelta(minutes=30),
        coordinator_rank: int = 0,
    ) -> None:
        super().__init__(worker, params, plan, timeout=timeout)
        self.coordinator_rank = coordinator_rank
        self.last_staleness: list[int] = []
        self.gate_seconds = 0.0
        self._ticks: deque[Future[Any]] = deque()

    @property
    def clock(self) -> int:
        """Pushes this worker has made."""
        return self.step

    def push(self, grads: Sequence[Tensor | None], lrs: Sequence[float], *, pull: bool) -> None:
        """Push ``grads`` (flat optimizer order) to every shard; copy the answers in when ``pull``.

        Each shard applies the push on arrival; this waits only for the shards' answers, never
        for another worker. Afterwards the coordinator learns the new clock (without waiting).
        """
        start = time.perf_counter()
        futures: dict[int, Future[Any]] = {}
        for s, idx in enumerate(self.plan):
            if not idx:
                continue
            part = [g.detach() if (g := grads[i]) is not None else None for i in idx]
            self.stats.bytes_sent += _nbytes(part)
            shard = local_shard(s)
            if isinstance(shard, AsyncParameterShard):
                futures[s] = _done(shard.push_pull(self.worker, part, list(lrs), pull=pull))
            else:
                futures[s] = rpc.rpc_async(
                    worker_name(s),
                    _rpc_async_push,
                    args=(s, self.worker, part, list(lrs), pull),
                    timeout=self.rpc_timeout,
                )
        self.stats.calls += len(futures)
        self.last_staleness = []
        for s, reply in self._wait_all(futures).items():
            self._take(s, reply)
            self.last_staleness.append(reply.staleness)
        self.step += 1
        self.last_wait_seconds = time.perf_counter() - start
        self.stats.seconds += self.last_wait_seconds
        self._tick()

    def pull(self) -> None:
        """Copy every shard's current values into the local parameters."""
        start = time.perf_counter()
        futures: dict[int, Future[Any]] = {}
        for s, idx in enumerate(self.plan):
            if not idx:
                continue
            shard = local_shard(s)
            if isinstance(shard, AsyncParameterShard):
                futures[s] = _done(shard.pull(self.worker))
            else:
                futures[s] = rpc.rpc_async(
                    worker_name(s), _rpc_async_pull, args=(s, self.worker), timeout=self.rpc_timeout
                )
        self.stats.calls += len(futures)
        for s, reply in self._wait_all(futures).items():
            self._take(s, reply)
        self.stats.seconds += time.perf_counter() - start

    def _take(self, s: int, reply: AsyncReply) -> None:
        self.last_server_bytes[s] = reply.step_bytes
        if reply.values is None:
            return
        with torch.no_grad():
            for i, v in zip(self.plan[s], reply.values, strict=True):
                self.params[i].copy_(v)
        self.stats.bytes_received += _nbytes(reply.values)

    def _tick(self) -> None:
        coordinator = local_coordinator() if self.coordinator_rank == self.worker else None
        if coordinator is not None:
            coordinator.tick(self.worker, self.step)
            return
        # fire and forget: the next draw carries the clock too; only a failure is reported
        while self._ticks and self._ticks[0].done():
            self._wait(self.coordinator_rank, self._ticks.popleft())
        self._ticks.append(
            rpc.rpc_async(
                worker_name(self.coordinator_rank), _rpc_tick, args=(self.worker, self.step), timeout=self.rpc_timeout
            )
        )

    def draw(self, epoch: int, plan: DataPlan, *, ahead: bool = False) -> Draw:
        """The next batch of indices of ``epoch`` (``indices`` is ``None``: the epoch is over).

        Blocks while the staleness gate holds this worker back; the time is added to
        ``gate_seconds``.
        """
        return draw_batch(
            self.worker,
            epoch,
            self.step,
            plan,
            coordinator_rank=self.coordinator_rank,
            rpc_timeout=self.rpc_timeout,
            ahead=ahead,
            client=self,
        )


def draw_batch(
    worker: int,
    epoch: int,
    clock: int,
    plan: DataPlan,
    *,
    coordinator_rank: int,
    rpc_timeout: float,
    ahead: bool = False,
    client: AsyncParameterServerClient | None = None,
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
    start = time.perf_counter()
    coordinator = local_coordinator() if worker == coordinator_rank else None
    if coordinator is not None:
        fut = coordinator.draw(worker, epoch, clock, plan, ahead=ahead)
    else:
        fut = rpc.rpc_async(
            worker_name(coordinator_rank),
            _rpc_draw,
            args=(worker, epoch, clock, plan, ahead),
            timeout=rpc_timeout,
        )
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
    try:
        result = fut.wait()
    except Exception as err:
        raise RuntimeError(f"{where}: {err}") from err
    if isinstance(result, ShardError):
        raise (TimeoutError if result.timed_out else RuntimeError)(f"{where}: {result.message}")
    if client is not None:
        client.gate_seconds += result.waited
        client.stats.seconds += max(0.0, time.perf_counter() - start - result.waited)
    return result
