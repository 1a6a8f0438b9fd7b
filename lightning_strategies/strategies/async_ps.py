"""``AsyncParameterServerStrategy`` ("async"): asynchronous sharded parameter servers.

Pushes applied on arrival (:mod:`lightning_strategies.comm.async_ps`), batches leased from one queue on rank 0
(:mod:`lightning_strategies.comm.async_`). The hooks changed relative to ``"ps"`` are:

- ``setup``: the coordinator on rank 0, a lease on every rank; refuse what needs equal batch counts.
- ``process_dataloader``: the training loader draws from the lease (:class:`DynamicBatchSampler`).
- ``training_step``: note the leased batch the step trains; admit it under the bound.
- ``setup_optimizers``: ``estimated_stepping_batches`` sees the mean batches per worker.
- ``_make_shard`` / ``client_class``: asynchronous shards and clients.
- ``optimizer_step`` (``_push_pull``): accumulate ``push_every`` steps, push, pull every ``pull_every``, tell
  the lease; flush at the epoch's last batch. A step the gradient scaler skipped pushes nothing but still
  counts. ``_collect_own_metrics``: staleness, waits, clock.
- ``broadcast_buffers_each_step = False``: no per-step collective (the ranks' step counts differ).
- ``on_validation_start`` / ``on_train_end`` / ``lightning_module_state_dict``: a barrier, the latest weights + buffers.
- ``on_exception``: tell the coordinator, so no refill waits on this worker's clock.
- On several nodes (:mod:`._async_nodes`, :mod:`~lightning_strategies.comm.async_hierarchy`) the node is the
  worker: its leader leases a unit of one batch per process, the node sums its gradients, pushes ``1/L`` from
  each process and all-gathers the values.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_strategies.comm.async_ import (
    DEFAULT_LEASE,
    AsyncCoordinator,
    BatchLease,
    DataPlan,
    LeasedBatch,
    register_coordinator,
    report_failure,
    unregister_coordinator,
)
from lightning_strategies.comm.async_hierarchy import HierarchicalAsyncClient
from lightning_strategies.comm.async_ps import (
    STALENESS_LR,
    AsyncParameterServerClient,
    AsyncParameterShard,
    StalenessLR,
)
from lightning_strategies.comm.ps import OptimizerSpec, Packed, ParameterServerClient, Slice, broadcast_from_rank0
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.data import DevicePrefetcher
from lightning_strategies.strategies._async_nodes import NodeWorkerStrategy
from lightning_strategies.strategies._base import exposed, is_last_batch
from lightning_strategies.strategies._dynamic_batches import (
    DynamicBatchSampler,
    check_loop,
    training_plan,
    with_batch_sampler,
)
from lightning_strategies.strategies._lightning_internals import per_rank_sigterm
from lightning_strategies.strategies._ps_clipping import prenormalise_like_lamb

__all__ = ["AsyncParameterServerStrategy", "DynamicBatchSampler"]

log = logging.getLogger(__name__)

_COORDINATOR_RANK = 0


class AsyncParameterServerStrategy(NodeWorkerStrategy):
    """Asynchronous data parallelism through sharded, co-located parameter servers.

    Workers push gradients to the shards, which apply them on arrival (with the worker's lr), and pull the
    weights back without waiting for each other; batches come from one shared queue per epoch, leased a few
    at a time, so a fast worker trains more of them and each epoch still covers every sample once. A push is
    one step on one worker's batch: use that batch's lr, and lower the momentum (asynchrony adds about
    ``1 - 1/P`` for ``P`` workers, Mitliagkas et al. 2016). A gradient's *staleness* is the updates a shard
    applied between the worker's pull and its push (about ``P-1``). Logged per step: ``"ps"``'s bytes,
    ``async/staleness_mean``, ``async/staleness_max``, ``async/wait_seconds`` (the bound's),
    ``async/lease_wait_seconds``, ``async/clock`` (pushes) and, with a bound, ``async/clock_gap_max``. Checked
    at setup: ``max_steps=-1``, validation and checkpoints at epoch ends, a map-style dataset with a batch
    per process. On a fault: as ``"ps"``; a hung rank fails the others when the gate (after ``timeout``) or
    an RPC to it gives up (to survive lost workers: :class:`~lightning_strategies.AsyncElasticStrategy`).
    Gradient clipping (``Trainer(gradient_clip_val=...)``, a custom ``configure_gradient_clipping`` too) runs on
    the worker, as Lightning's: each push is one worker's gradient applied alone, as one step on one device, so
    clipping that whole gradient is the single-device semantics. For the same reason ``Lamb(max_grad_norm=...)``
    over several shards pre-normalises each pushed gradient on the worker by its own norm (the shards' Lamb then
    finds every slice within the bound).

    On several nodes (``hierarchical=None``, as ``"ps"``'s) the *node* is the asynchronous worker, synchronous
    inside (:mod:`~lightning_strategies.comm.async_hierarchy`): staleness, clocks, the bound and the lease are
    the node's, and a straggling process stalls its node. It needs ``num_servers=None``, ``push_every=1`` and
    ``pull_every=1`` (else the push is flat; under ``hierarchical=True`` an error).

    Args:
        max_staleness: no worker starts step ``c+1`` before every worker has pushed step
            ``c - max_staleness``; ``None``: no bound.
        push_every: accumulate the local gradients of this many steps (averaged), then push.
        pull_every: fetch the weights every this many steps (with the push when both are due).
        staleness_lr: ``"none"``, or ``"inverse"`` to divide each gradient's lr by ``1 + staleness`` on the shard.
        lease: batches a worker leases at a time (refilled when half are used).
        **kwargs: everything :class:`~lightning_strategies.ParameterServerStrategy` takes (``timeout`` also
            bounds a gated draw).

    Raises:
        ValueError: for an invalid ``max_staleness``, ``push_every``, ``pull_every``, ``lease`` or ``staleness_lr``.
        TypeError: for a ``timeout`` that is not a ``datetime.timedelta``, or ``dedicated_servers=True``
            (:class:`~lightning_strategies.AsyncElasticStrategy`).
    """

    strategy_name = "async"
    # ranks take different numbers of steps: a per-step collective would pair different steps, so
    # buffers come from rank 0 at consistent points only and an overflow skips one worker's push
    broadcast_buffers_each_step: ClassVar[bool] = False
    agree_on_overflow: ClassVar[bool] = False
    # a push is one worker's step applied alone: the worker clips its own gradient, as on one device
    clips_on_servers: ClassVar[bool] = False
    overlap_supported: ClassVar[bool] = False  # no per-step barrier: pushes and pulls keep their own schedule
    aligns_pushes: ClassVar[bool] = False  # the same: no step every worker takes together
    client_class: ClassVar[type[ParameterServerClient]] = AsyncParameterServerClient
    # on several nodes the node's processes step together (the node is the asynchronous worker)
    hierarchical_push: ClassVar[bool] = True

    def __init__(
        self,
        *,
        max_staleness: int | None = None,
        push_every: int = 1,
        pull_every: int = 1,
        staleness_lr: StalenessLR = "none",
        lease: int = DEFAULT_LEASE,
        **kwargs: Any,
    ) -> None:
        _check_options(max_staleness, push_every, pull_every, kwargs, staleness_lr, lease)
        super().__init__(**kwargs)
        self.max_staleness = max_staleness
        self.push_every = push_every
        self.pull_every = pull_every
        self.staleness_lr: StalenessLR = staleness_lr
        self.lease = lease
        self._coordinator: AsyncCoordinator | None = None
        self._lease: BatchLease | None = None
        self._plan: DataPlan | None = None
        self._limit: int | None = None  # Trainer(limit_train_batches=n): batches per rank and epoch
        self._drawn: deque[LeasedBatch] = deque()  # drawn from the lease, not trained yet (in order)
        self._stepped = False  # this optimizer_step reached the push (the scaler did not skip it)
        self._step_staleness: list[int] = []  # staleness of this step's push (one per shard)
        self._reset_fit_state()

    coordinator: AsyncCoordinator | None = exposed(
        "_coordinator", "The clocks, bound and data queue (on rank 0 while fitting)."
    )
    batch_lease: BatchLease | None = exposed("_lease", "This worker's lease of batches (while fitting).")

    @property
    def async_client(self) -> AsyncParameterServerClient | None:
        """This worker's push/pull/draw handle (``None`` outside of fitting)."""
        client = self._client
        return client if isinstance(client, AsyncParameterServerClient) else None

    @property
    def _num_workers(self) -> int:
        nodes = self._nodes
        return nodes.layout.num_nodes if nodes is not None else self.num_nodes * self.num_processes

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            check_loop(type(self).__name__, trainer)
            self._reset_fit_state()
            self._plan_nodes(push_every=self.push_every, pull_every=self.pull_every)
            # the training loader draws its first batch while the optimizers are configured
            self._start_coordination(trainer)
        super().setup(trainer)

    def _start_coordination(self, trainer: pl.Trainer) -> None:
        if self.global_rank == _COORDINATOR_RANK:
            self._coordinator = AsyncCoordinator(
                self._worker_ids, self.max_staleness, timeout=self.ps_timeout, push_every=self.push_every
            )
            register_coordinator(self._coordinator)
        if self._nodes is None or self._nodes.is_leader:
            self._lease = self._new_lease()
        self.barrier("async_coordinator_ready")
        per_rank_sigterm(trainer)

    def _new_lease(self, incarnation: int = 0) -> BatchLease:
        return BatchLease(
            self._worker_id,
            coordinator_rank=_COORDINATOR_RANK,
            rpc_timeout=self._rpc_timeout,
            lease=self.lease,
            max_staleness=self.max_staleness,
            incarnation=incarnation,
        )

    def _reset_fit_state(self) -> None:
        self._local_steps, self._accumulated = 0, _Accumulator()
        # pushes that skipped steps did not make: the lease's and the bound's clock is the client's pushes plus these
        self._skipped_pushes = 0
        self._drawn.clear()
        self._unpushed: list[LeasedBatch] = []  # trained since the last push
        self._gap_max: int | None = None
        self._lease_waited = (0.0, 0.0)  # the lease's (wait, gate) seconds at the last log
        self._staleness_sum = self._staleness_count = 0  # of the pushes since the last log

    @property
    def _rpc_timeout(self) -> float:
        # as the shards' clients: the coordinator's own error (after `timeout`) arrives first
        seconds = self.ps_timeout.total_seconds()
        return seconds + max(5.0, 0.1 * seconds)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The optimizers, with ``estimated_stepping_batches`` from the mean batches per worker; the loop's
        length is unknown again afterwards (a known one would end a fast worker's epoch at its "share")."""
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup_optimizers(trainer)
            return
        fit_loop = trainer.fit_loop
        fit_loop.setup_data()
        unknown = fit_loop.max_batches
        if self._plan is not None and unknown == float("inf"):
            fit_loop.max_batches = math.ceil(self._plan.num_batches / self._num_workers)
        try:
            super().setup_optimizers(trainer)
        finally:
            fit_loop.max_batches = unknown
        _warn_high_momentum(self._num_workers, self.optimizers)

    @override
    def _make_shard(
        self, shard_id: int, slices: Sequence[Slice], params: Sequence[Tensor], spec: OptimizerSpec
    ) -> AsyncParameterShard:
        return AsyncParameterShard(
            shard_id, slices, params, spec, self._worker_ids, staleness_lr=self.staleness_lr, timeout=self.ps_timeout
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give the training loader a :class:`DynamicBatchSampler`; other loaders pass through."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if isinstance(dataloader, DevicePrefetcher):
            # on CUDA the copy ahead takes each batch one step before Lightning does: one more drawn ahead
            inner = self.process_dataloader(dataloader.loader)
            if dataloader.active and self._lease is not None:
                self._lease.prefetch += 1
            return DevicePrefetcher(inner, dataloader.device, non_blocking=dataloader.non_blocking)  # type: ignore[arg-type]
        plan = training_plan(type(self).__name__, dataloader, self._num_workers)
        if self._nodes is not None:
            plan = self._nodes.plan(plan)
        assert isinstance(dataloader, DataLoader)
        return self._training_loader(dataloader, plan)

    def _training_loader(self, dataloader: DataLoader, plan: DataPlan) -> object:
        trainer = self.trainer
        assert trainer is not None
        limit = trainer.limit_train_batches
        self._limit = limit if isinstance(limit, int) else None
        workers = self._num_workers
        if isinstance(limit, int) and plan.num_batches < limit * workers:
            who, unit = ("nodes", "units (a batch per process)") if self._nodes else ("processes", "batches")
            raise ValueError(
                f"{type(self).__name__} found Trainer(limit_train_batches={limit}) with {workers} {who} "
                f"and {plan.num_batches} {unit} per epoch: expected at least {limit} x {workers} = "
                f"{limit * workers} {unit}, so that every rank reaches its limit (and validates). Fix: "
                f"limit_train_batches <= {plan.num_batches // workers}."
            )
        self._plan = plan
        if self._lease is not None:
            # Lightning draws one batch ahead of its step, loader processes prefetch_factor each more
            workers = dataloader.num_workers
            self._lease.prefetch = 1 + (workers * (dataloader.prefetch_factor or 2) if workers > 0 else 0)
        sampler = DynamicBatchSampler(plan, self._draw, self._current_epoch, self._give_back)
        return with_batch_sampler(dataloader, sampler)

    def _current_epoch(self) -> int:
        trainer = self.trainer
        if trainer is None:
            return 0
        # the epoch being run (`current_epoch` counts completed ones, one less during the epoch end)
        return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]

    def _draw(self, epoch: int, plan: DataPlan) -> list[int] | None:
        """The next batch of the lease; runs in the training process (the sampler's ``next``). On several
        nodes the leader draws a unit and the node's processes each take their part of it."""
        lease, batch, stopped = self._lease, None, False
        if lease is not None:
            batch = lease.next(epoch, plan, limit=self._limit, should_stop=self._told_to_stop)
            stopped = lease.stopped
        batch, stopped = self._share_in_node((batch, stopped))
        if batch is None:
            if stopped and (trainer := self.trainer) is not None:
                trainer.should_stop = True  # the chief ended the run: this loop ends with it
            return None
        self._drawn.append(batch)  # loaders keep the sampler's order: the steps train them in this order
        return self._nodes.part(batch)[0] if self._nodes is not None else batch.indices

    def _give_back(self) -> None:
        """Return the batches drawn from the lease that no step trained (the loop dropped them)."""
        if self._drawn and self._lease is not None:
            self._lease.give_back(list(self._drawn))
        self._drawn.clear()

    def _told_to_stop(self) -> bool:
        return bool(getattr(self.trainer, "received_sigterm", False))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Note the leased batch this step trains and admit it under the bound (here, not in the
        sampler, which runs ahead); when the bound held it back, pull the others' pushes first."""
        if self._fitting() and self._drawn:
            batch = self._drawn.popleft()
            self._unpushed.append(batch)
            lease, client = self._lease, self.async_client
            if client is not None and (lease is not None or self._nodes is not None):
                with self._peer_watch():
                    held = False
                    if lease is not None:
                        gap = lease.admit(batch, self._step_clock, should_stop=self._told_to_stop)
                        if gap is not None:
                            self._gap_max = gap if self._gap_max is None else max(self._gap_max, gap)
                        held = lease.take_held()
                    held = self._node_step(batch, held, bounded=self.max_staleness is not None)
                    if held and self.pull_every == 1:
                        client.pull()
        return super().training_step(*args, **kwargs)

    @property
    def _step_clock(self) -> int:  # as the lease and the bound count steps: pushes made and skipped
        client = self.async_client
        return (client.clock if client is not None else 0) + self._skipped_pushes

    @override
    def optimizer_step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Push/pull as ``"ps"`` does; a step the gradient scaler skipped (or whose loss is ``None``) pushes
        nothing but still counts (batch acked, clock advanced), or the others would wait for its push."""
        self._stepped = False
        out = super().optimizer_step(optimizer, *args, **kwargs)
        if not self._stepped and self._fitting() and self.async_client is not None:
            self._end_step(optimizer, skipped=True)
        return out

    @override
    def _push_pull(self, optimizer: Optimizer) -> None:
        self._stepped = True
        self._end_step(optimizer, skipped=False)

    def _end_step(self, optimizer: Optimizer, *, skipped: bool) -> None:
        """Accumulate, push, pull and tell the lease after a step (``skipped``: its gradients left out)."""
        client = self.async_client
        assert client is not None
        grads: list[Tensor | None] | None = None if skipped else [p.grad for p in client.params]
        self._local_steps += 1
        trainer = self.trainer
        flush = trainer is not None and is_last_batch(trainer)
        push_due = self._local_steps % self.push_every == 0 or flush
        pull_due = self._local_steps % self.pull_every == 0 or flush
        if self.push_every > 1:
            grads = self._accumulated.add(grads, take=push_due)
        if isinstance(client, HierarchicalAsyncClient) and grads is None:
            grads = [None] * len(client.params)  # the node pushes together: a skipped step adds nothing
        if push_due:
            if grads is not None:
                if self._global_norm_max is not None:  # Lamb(max_grad_norm) over several shards
                    prenormalise_like_lamb(grads, self._global_norm_max)
                client.push(grads, self._push_lrs(optimizer), pull=pull_due)
                self._step_staleness = client.last_staleness
            else:
                self._skipped_pushes += 1  # every step since the last push was skipped: nothing to push
                if pull_due:
                    client.pull()
            if self._lease is not None:
                self._lease.pushed(self._step_clock, self._unpushed)
            self._unpushed = []
        elif pull_due:
            client.pull()
        if flush:
            self._local_steps = 0
            if self._lease is not None:
                # the epoch's clock and acks reach the coordinator before its end
                self._lease.flush(publish=self._epoch_end_publish())

    def _push_lrs(self, optimizer: Optimizer) -> list[float]:
        return [float(g["lr"]) for g in optimizer.param_groups]

    def _epoch_end_publish(self) -> dict[str, Packed] | None:
        """What a worker publishes with its last push of an epoch: nothing here."""
        return None

    @override
    def _collect_own_metrics(self, stats: CommStats) -> None:
        client = self.async_client
        assert client is not None
        # means per step, except the staleness: its mean and maximum over the window's pushes
        staleness, self._step_staleness = self._step_staleness, []
        self._staleness_sum += sum(staleness)
        self._staleness_count += len(staleness)
        lease = self._lease
        if lease is not None:
            (wait, gate), self._lease_waited = self._lease_waited, (lease.wait_seconds, lease.gate_seconds)
            self.metrics.add(**{"async/wait_seconds": lease.gate_seconds - gate})
            self.metrics.add(**{"async/lease_wait_seconds": lease.wait_seconds - wait})
        if self._gap_max is not None:
            self.metrics.peak(**{"async/clock_gap_max": self._gap_max})
            self._gap_max = None
        self.metrics.peak(**{"async/staleness_max": max(staleness, default=0)})
        mean = self._staleness_sum / self._staleness_count if self._staleness_count else 0.0
        self.metrics.latest(**{"async/staleness_mean": mean, "async/clock": client.clock})

    @override
    def _after_optimizer_step(self) -> None:
        super()._after_optimizer_step()
        if not self.metrics:  # flushed: the next window's staleness starts afresh
            self._staleness_sum = self._staleness_count = 0

    def _pull_latest(self, reason: str, *, last: bool = False) -> None:
        """Barrier (every push is in), the latest weights and rank 0's buffers; with ``last`` a
        second barrier keeps every shard up until every rank has pulled (teardown drops them)."""
        client = self.async_client
        if client is None:
            return
        self.barrier(reason)
        client.pull()
        if self._buffers:
            broadcast_from_rank0(self._buffers)
        if last:
            self.barrier(f"{reason}_pulled")

    @override
    def on_validation_start(self) -> None:
        self._pull_latest("async_validation")
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._pull_latest("async_train_end", last=True)
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The latest weights: every rank calls this from ``Trainer.save_checkpoint``, before the
        optimizer state is gathered, so after the barrier the shards hold every push."""
        self._pull_latest("async_checkpoint")
        return super().lightning_module_state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Fail the refills that wait on this worker's clock at once (the bound would wait ``timeout``)."""
        if self._rpc_started and self._fitting():
            reason = f"{type(exception).__name__}: {exception}"
            report_failure(self._worker_id, reason, coordinator_rank=_COORDINATOR_RANK)
        super().on_exception(exception)
        self._close_nodes()

    @override
    def teardown(self) -> None:
        if self._coordinator is not None:
            unregister_coordinator()
            self._coordinator.shutdown()
            self._coordinator = None
        self._lease = None
        self._reset_fit_state()
        super().teardown()
        self._close_nodes()


def _check_options(
    max_staleness: int | None, push_every: int, pull_every: int, kwargs: dict[str, Any], staleness_lr: str, lease: int
) -> None:
    name = "AsyncParameterServerStrategy"
    if kwargs.pop("dedicated_servers", False):
        raise TypeError(
            f"{name}(dedicated_servers=True): found the option of the elastic strategy: expected "
            "AsyncElasticStrategy, the class of 'async_elastic'. Fix: AsyncElasticStrategy(num_servers=S), or "
            "Trainer(strategy='async_elastic')."
        )
    timeout = kwargs.get("timeout")
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        raise ValueError(
            f"{name}(max_staleness={max_staleness!r}): expected an integer >= 0 (0 = bulk-synchronous schedule) "
            "or None (no bound). Fix: pass e.g. max_staleness=2, or None."
        )
    for key, value in (("push_every", push_every), ("pull_every", pull_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name}({key}={value!r}): expected an integer >= 1 (steps between exchanges). Fix: pass "
                f"{key}=1 to exchange every step."
            )
    if kwargs.get("hierarchical") and (push_every != 1 or pull_every != 1):
        raise ValueError(
            f"{name}(hierarchical=True, push_every={push_every}, pull_every={pull_every}): expected push_every=1 "
            "and pull_every=1, because a node's processes push and pull together, every step. Fix: drop "
            "push_every/pull_every, or pass hierarchical=False."
        )
    if isinstance(lease, bool) or not isinstance(lease, int) or lease < 1:
        raise ValueError(
            f"{name}(lease={lease!r}): expected an integer >= 1 (batches a worker leases at a time). Fix: pass "
            f"lease={DEFAULT_LEASE}, or 1 to take one batch per request."
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"{name}(timeout={timeout!r}): expected a datetime.timedelta, as DDPStrategy takes. Fix: pass "
            f"timeout=datetime.timedelta(seconds={timeout if isinstance(timeout, int | float) else 1800})."
        )
    if staleness_lr not in STALENESS_LR:
        raise ValueError(
            f"{name}(staleness_lr={staleness_lr!r}): expected one of {list(STALENESS_LR)}. Fix: 'none' keeps the "
            "worker's lr, 'inverse' divides it by 1 + the gradient's staleness."
        )


def _warn_high_momentum(workers: int, optimizers: Sequence[Optimizer]) -> None:
    # asynchrony adds a momentum of about 1 - 1/P (Mitliagkas et al. 2016): with SGD's 0.9 the sum passes 1 (diverges)
    if workers < 2:
        return
    implicit = 1.0 - 1.0 / workers
    for optimizer in optimizers:
        momenta = [float(g.get("momentum", g.get("betas", (0.0,))[0])) for g in optimizer.param_groups]
        if momenta and max(momenta) + implicit > 1.0:
            rank_zero_warn(
                f"async with {workers} workers adds an implicit momentum of about {implicit:.2f} "
                f"to the optimizer's {max(momenta):g} (Mitliagkas et al. 2016): together above 1, training "
                f"often diverges. Lower it, e.g. SGD(momentum={max(0.0, 1.0 - implicit):g}), or the lr."
            )
            return


class _Accumulator:
    """Local gradient sums over the steps between two pushes (``push_every``)."""

    def __init__(self) -> None:
        self.sums: list[Tensor | None] = []
        self.steps = 0

    def add(self, grads: list[Tensor | None] | None, *, take: bool) -> list[Tensor | None] | None:
        """Add this step's gradients (``None``: a skipped step's, left out); when ``take``, return
        their mean (``None`` if every step was skipped) and reset."""
        if grads is not None:
            if not self.sums:
                self.sums = [None] * len(grads)
            for i, g in enumerate(grads):
                if g is not None:
                    acc = self.sums[i]
                    self.sums[i] = g.detach().clone() if acc is None else acc.add_(g.detach())
            self.steps += 1
        if not take:
            return grads
        if self.steps == 0:
            return None
        mean = [a.div_(self.steps) if a is not None else None for a in self.sums]
        self.sums, self.steps = [], 0
        return mean
