"""``AsyncParameterServerStrategy`` ("async"): asynchronous sharded parameter servers.

The synchronous strategy (:mod:`.parameter_server`) makes every worker wait for the slowest
at every step. Here no step waits for another worker: each push is applied by the shards on
arrival (:mod:`lightning_strategies.comm.async_ps`), optionally held back only by a
stale-synchronous bound on the workers' clocks (``max_staleness``). For that to pay off the data
must be shared dynamically too: every worker takes its batches from one queue per epoch (hosted
by rank 0), a few at a time (a lease, refilled in the background), so a fast worker trains on
more batches than a slow one while the epoch still covers every sample exactly once. The hooks
changed relative to ``"ps"`` are:

- ``setup``: host the coordinator (clocks, bound, queue;
  :mod:`lightning_strategies.comm.coordinator`) on rank 0 and give every rank its lease
  (:mod:`lightning_strategies.comm.lease`); refuse what cannot work with different batch counts
  per rank (``max_steps``, batch-based validation).
- ``process_dataloader``: replace the training loader's sampler by a :class:`DynamicBatchSampler`
  that reads the lease (Lightning's ``DistributedSampler``, if it injected one, is dropped;
  validation and test loaders keep it); a :class:`~lightning_strategies.DevicePrefetcher` keeps wrapping
  the new loader.
- ``training_step``: note which leased batch the step trains (its push acks it) and the
  staleness gap; pull first when the bound held the lease back.
- ``setup_optimizers``: give ``Trainer.estimated_stepping_batches`` the mean batches per worker
  (the dynamic loader has no length) while ``configure_optimizers`` runs.
- ``_make_shard`` / ``_make_client``: asynchronous shards and clients instead of ``"ps"``'s.
- ``optimizer_step`` (through ``_push_pull``): accumulate ``push_every`` steps, push, pull
  every ``pull_every`` steps, tell the lease; flush at the epoch's last batch. A step the
  gradient scaler skipped pushes nothing but still counts (acked, the clock advances).
  ``_collect_own_metrics``: the staleness, the bound's wait, the lease's wait and the clock.
- ``broadcast_buffers_each_step = False``: no per-step collective (the ranks' step counts
  differ here, so a per-step collective would pair steps of different ranks).
- ``on_validation_start`` / ``on_train_end`` / ``lightning_module_state_dict``: a barrier (all
  pushes are in), then every worker pulls the latest weights and rank 0's buffers, so
  validation, the checkpoint and the returned model see one consistent state (with dedicated
  servers: the chief, once the epoch's every batch is pushed, with the latest worker's buffers).
- ``on_exception``: tell the coordinator, so no refill waits on this worker's clock.
- with ``dedicated_servers``: ``setup_distributed`` / ``_start_rpc`` (the job's store, a process
  group per process, RPC with joins), ``setup`` / ``_start_servers`` (roles, the coordinator and
  the membership monitor on the chief, joins), ``process_dataloader`` (the servers' loop follows
  the workers' progress), ``distributed_sampler_kwargs`` / ``barrier`` / ``reduce_boolean_decision``
  (nothing spans processes), ``on_train_end`` / ``teardown`` (leave, no graceful RPC shutdown).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from lightning_strategies.comm.async_ps import (
    STALENESS_LR,
    AsyncParameterServerClient,
    AsyncParameterShard,
    StalenessLR,
)
from lightning_strategies.comm.coordinator import AsyncCoordinator, DataPlan, LeasedBatch
from lightning_strategies.comm.lease import DEFAULT_LEASE, BatchLease, report_failure
from lightning_strategies.comm.ps import OptimizerSpec, Slice, broadcast_from_rank0, pack
from lightning_strategies.comm.rpc import register_coordinator, unregister_coordinator
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.data import DevicePrefetcher
from lightning_strategies.strategies._base import is_last_batch
from lightning_strategies.strategies._elastic import DedicatedServers, ElasticScriptLauncher
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy

__all__ = ["AsyncParameterServerStrategy", "DynamicBatchSampler"]

log = logging.getLogger(__name__)

_COORDINATOR_RANK = 0


class DynamicBatchSampler(Sampler[list[int]]):
    """A batch sampler that takes each next batch from a shared queue and stops when it is empty.

    It has no ``__len__`` on purpose: each rank takes as many batches as it can process, so
    Lightning treats the loader as of unknown length (fetching one batch ahead to find the
    epoch's last batch, and validating after it).

    Args:
        plan: how the epoch is batched (the same on every rank).
        draw: ``draw(epoch, plan)`` returns the next indices, or ``None`` at the end (it runs in
            the training process, also with loader processes: they receive indices from it).
        restart: called when an iteration starts (Lightning drops an iterator it prefetched from
            when it starts a new one).
        epoch: returns the current epoch when an iteration starts.
    """

    def __init__(
        self,
        plan: DataPlan,
        draw: Callable[[int, DataPlan], list[int] | None],
        epoch: Callable[[], int],
        restart: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self._draw = draw
        self._epoch = epoch
        self._restart = restart

    def __iter__(self) -> Iterator[list[int]]:
        if self._restart is not None:
            self._restart()  # a new iteration: what the last one drew and no step trained is given back
        epoch = self._epoch()  # read lazily: Lightning creates the iterator before the epoch starts
        while (batch := self._draw(epoch, self.plan)) is not None:
            yield batch


class AsyncParameterServerStrategy(ParameterServerStrategy):
    """Asynchronous data parallelism through sharded, co-located parameter servers.

    Every worker pushes its gradients to the shards, which apply them at once with the user's
    optimizer (the worker's learning rate travels with each push), and pulls the weights back,
    without waiting for any other worker. Batches come from one shared queue per epoch, leased a
    few at a time (``lease``) and refilled in the background, so a fast worker processes more of
    them than a slow one and no step waits for the coordinator while its lease lasts; each epoch
    still covers every sample exactly once.

    A worker's *clock* is the number of pushes it has made. With ``max_staleness=s`` no worker
    starts step ``c+1`` before every worker has pushed step ``c-s`` (stale-synchronous
    parallel): ``s=0`` is a bulk-synchronous schedule, ``None`` never waits. The bound is checked
    where each step starts, in the training process (not in the sampler, which loader processes
    and Lightning's one-batch prefetch run ahead of the steps), so it holds with
    ``DataLoader(num_workers > 0)`` too: at once when the clocks known when the step's batch was
    leased allow it, else after a round trip to the coordinator's gate; leases are also held back
    near the bound, so a waiting worker does not hoard the queue (with ``s=0``, about one gate
    round trip per step). At an epoch's end a worker whose batches are used up no longer holds
    the others back until the next epoch starts (it has nothing left to push). A gradient's
    *staleness* is the number of updates a shard applied between the worker's pull of the
    weights it used and its push; with ``P`` equally fast workers it averages about ``P-1``.

    Logged at Lightning's step-logging cadence, as per-step means since the last log:
    ``comm/bytes_sent``, ``comm/bytes_received``, ``ps/server_bytes_max`` (as for ``"ps"``),
    ``async/staleness_mean``, ``async/staleness_max`` (over the pushes since the last log),
    ``async/wait_seconds`` (time the staleness bound held the lease back), ``async/lease_wait_seconds``
    (time a step waited for its lease: the coordinator on the critical path), ``async/clock`` and,
    with a bound, ``async/clock_gap_max`` (this worker's clock at a step minus the others' lowest
    clock when its batch was leased: at most ``max_staleness``).

    Learning rate and momentum: each worker's push is one optimizer step on its *own* batch (not
    the average of ``P`` batches), so use the per-worker batch's learning rate (no linear scaling
    by ``P``). Asynchrony behaves like extra momentum of about ``1 - 1/P`` (Mitliagkas et al.
    2016, "Asynchrony begets momentum"), so lower the optimizer's momentum (the digits ResNet
    diverges at 0.9 with ``P=2`` and trains at 0.5) or the learning rate; ``staleness_lr=
    "inverse"`` damps stale gradients further. LR schedules run on each worker's own step count,
    estimated as the mean batches per worker (a fast worker reaches the schedule's end early);
    with dedicated servers on the chief's, which follows the mean worker's.

    Requirements (each checked at setup, with the fix in the message): epochs, not steps
    (``max_steps=-1``; the ranks take different numbers of steps), validation once per epoch or
    every n epochs (``val_check_interval=1.0``), a map-style training dataset in a
    ``DataLoader`` with at least as many batches per epoch as processes, and everything ``"ps"``
    requires. Checkpoints are consistent
    at epoch ends (where ``ModelCheckpoint`` saves by default); a mid-epoch checkpoint does not
    record the queue's position.

    On a fault: as for ``"ps"``, a dead rank's shard (and, for rank 0, the coordinator) fails the
    survivors' next push, pull or refill at once; a hung rank fails them when the gate (after
    ``timeout``) or an RPC to it (after ``timeout`` + max(5 s, 10%)) gives up. The error names the
    lost rank(s) (``"async: lost peer rank 1 of 4: ..."``; :class:`~lightning_strategies.PeerLostError`
    when a step failed). A rank that fails on its own error first tells the coordinator, so no
    refill waits on its clock.

    With ``dedicated_servers=True`` (``"async_elastic"``) the run survives its workers: ranks
    ``0 .. num_servers-1`` serve the shards and do not train, rank 0 (the chief) also serves the
    job's store and the coordinator, validates on the whole validation set, writes the
    checkpoints and logs ``async/workers_alive``, ``async/workers_lost``, ``async/workers_joined``
    and ``async/batches_redrawn``. A worker killed, frozen past ``timeout`` or preempted (SIGTERM)
    is dropped and its leased, unpushed batches are trained by the others (every batch of an epoch
    counted once); a worker started again with the same rank rejoins, pulls the current weights
    and trains. Each process has a process group of its own, so no Lightning collective
    (barrier, broadcast, ``sync_dist``, the checkpoint's barrier) waits for another process; the
    LR schedule runs on the chief (its steps follow the mean worker's) and travels with the
    leases; BatchNorm statistics are the latest worker's. Servers are not replicated: a lost server
    fails every worker (naming it), and ``ckpt_path`` of the last checkpoint restores the shards
    exactly. (:mod:`lightning_strategies.strategies._elastic`, :mod:`lightning_strategies.comm.elastic`.)

    Args:
        max_staleness: the bound ``s`` on the workers' clock gap; ``None`` for none.
        push_every: accumulate the local gradients of this many steps (averaged), then push.
        pull_every: fetch the weights every this many steps (with the push when both are due).
        staleness_lr: ``"none"``, or ``"inverse"`` to divide each gradient's learning rate by
            ``1 + staleness`` on the shard.
        lease: batches a worker leases at a time (refilled when half are used; the coordinator
            leases fewer as the epoch's queue drains).
        dedicated_servers: ranks ``0 .. num_servers-1`` (``num_servers`` default 1) serve the shards
            and do not train, the others are workers; a lost worker is dropped and its batches
            redrawn, a restarted one rejoins (see "When a worker dies" in the README). Needs
            processes started independently (torchrun, SLURM, by hand) or ``start_method="popen"``.
        **kwargs: everything :class:`~lightning_strategies.ParameterServerStrategy` takes
            (``num_servers``: shards, one per process by default; ``timeout``: how long
            collectives and a gated draw wait for a slow or hung peer before failing, 30 minutes
            by default, as DDP; ``rpc_threads``, ``process_group_backend``, ``start_method``, and
            the plugins the Trainer sets).

    Raises:
        ValueError: for an invalid ``max_staleness``, ``push_every``, ``pull_every``, ``lease`` or
            ``staleness_lr``, or ``dedicated_servers`` with a fork/spawn launcher.
        TypeError: for a ``timeout`` that is not a ``datetime.timedelta``.
    """

    strategy_name = "async"
    # Buffers (BatchNorm statistics) stay local during the epoch and are taken from rank 0 before
    # validation and checkpoints (_pull_latest): ranks take different numbers of steps, so a
    # per-step collective would pair the steps of different ranks.
    broadcast_buffers_each_step: ClassVar[bool] = False
    # Under 16-mixed a worker whose gradients overflow skips its own push and lowers its own
    # scale (lightning_strategies.comm.amp); a per-step collective would pair different steps.
    agree_on_overflow: ClassVar[bool] = False

    def __init__(
        self,
        *,
        max_staleness: int | None = None,
        push_every: int = 1,
        pull_every: int = 1,
        staleness_lr: StalenessLR = "none",
        lease: int = DEFAULT_LEASE,
        dedicated_servers: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_options(max_staleness, push_every, pull_every, kwargs.get("timeout"), staleness_lr, lease)
        _check_dedicated(dedicated_servers, kwargs.get("start_method", "popen"))
        super().__init__(**kwargs)
        self.dedicated_servers = dedicated_servers
        # the layout whose workers may come and go: ranks 0 .. num_servers-1 serve, the others train
        self._members = DedicatedServers(self, self._num_servers or 1) if dedicated_servers else None
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
        self._unpushed: list[LeasedBatch] = []  # trained since the last push
        self._gap_max: int | None = None
        self._lease_waited = (0.0, 0.0)  # the lease's (wait, gate) seconds at the last log
        self._local_steps = 0
        self._accumulated: list[Tensor | None] = []
        self._accumulated_steps = 0
        # pushes a skipped step (its gradient scaler found an overflow) did not make: the clock the
        # lease and the staleness bound see is the client's pushes plus these
        self._skipped_pushes = 0
        self._stepped = False  # this optimizer_step reached the push (the scaler did not skip it)
        # staleness of this step's push (one per shard), and of the pushes since the last log
        self._step_staleness: list[int] = []
        self._staleness_sum = 0
        self._staleness_count = 0

    @property
    def coordinator(self) -> AsyncCoordinator | None:
        """The clocks, bound and data queue (on rank 0 while fitting; ``None`` elsewhere)."""
        return self._coordinator

    @property
    def batch_lease(self) -> BatchLease | None:
        """This worker's lease of batches (``None`` outside of fitting)."""
        return self._lease

    @property
    def async_client(self) -> AsyncParameterServerClient | None:
        """This worker's push/pull/draw handle (``None`` outside of fitting)."""
        client = self._client
        return client if isinstance(client, AsyncParameterServerClient) else None

    @property
    def members(self) -> DedicatedServers | None:
        """The dedicated-servers layout (``None`` with shared hosting)."""
        return self._members

    def epoch_samples(self, epoch: int) -> int | None:
        """With dedicated servers, on the chief: the samples of epoch ``epoch``'s batches the workers
        have pushed so far (throughput is counted there; the servers train nothing), else ``None``."""
        coordinator, plan = self._coordinator, self._plan
        if self._members is None or coordinator is None or plan is None:
            return None
        done = coordinator.done_count(epoch)
        full = done if done < plan.num_batches or plan.drop_last else done - 1
        last = plan.num_samples - (plan.num_batches - 1) * plan.batch_size if full < done else 0
        return full * plan.batch_size + last

    def _is_server_only(self) -> bool:
        return self._members is not None and self._members.is_server

    @property
    def _num_workers(self) -> int:
        """The training ranks: every rank with shared hosting, the non-servers with dedicated ones."""
        processes = self.num_nodes * self.num_processes
        return len(self._members.workers) if self._members is not None else processes

    # -- environment (dedicated servers: a process group per process, RPC with joins) -----------

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._members is not None and self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = ElasticScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_distributed(self) -> None:
        if self._members is not None:
            self.set_world_ranks()
            self._members.connect()  # a one-rank group: Lightning then finds it initialised
        super().setup_distributed()

    @override
    def _start_rpc(self) -> None:
        if self._members is None:
            super()._start_rpc()
        else:
            self._members.start_rpc()

    @override
    def setup_environment(self) -> None:
        if self._members is not None:
            self._members.check_world()
        super().setup_environment()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # dedicated servers: only the chief validates and tests run per process, on the whole set
        if self._members is not None:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._members is None:
            super().barrier(*args, **kwargs)  # with dedicated servers no process waits for another

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._members is not None:
            return bool(decision)  # each process decides for itself (the chief for the run)
        return super().reduce_boolean_decision(decision, all=all)

    # -- setup ---------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._members is not None:
            self._check_loop(trainer)
            self._reset_fit_state()
            self._members.setup(trainer)
            _without_per_step_collective(trainer)
        elif trainer.state.fn == TrainerFn.FITTING:
            self._check_loop(trainer)
            self._reset_fit_state()
            # the training loader draws its first batch while the optimizers are configured
            if self.global_rank == _COORDINATOR_RANK:
                self._coordinator = AsyncCoordinator(
                    self.world_size, self.max_staleness, timeout=self.ps_timeout, push_every=self.push_every
                )
                register_coordinator(self._coordinator)
            self._lease = BatchLease(
                self.global_rank,
                coordinator_rank=_COORDINATOR_RANK,
                rpc_timeout=self._rpc_timeout,
                lease=self.lease,
                max_staleness=self.max_staleness,
            )
            self.barrier("async_coordinator_ready")
            _without_per_step_collective(trainer)
        super().setup(trainer)

    def _reset_fit_state(self) -> None:
        self._local_steps, self._accumulated, self._accumulated_steps = 0, [], 0
        self._skipped_pushes = 0
        self._drawn.clear()
        self._unpushed, self._gap_max, self._lease_waited = [], None, (0.0, 0.0)

    @property
    def _rpc_timeout(self) -> float:
        # as the shards' clients: the coordinator's own error (after `timeout`) arrives first
        seconds = self.ps_timeout.total_seconds()
        return seconds + max(5.0, 0.1 * seconds)

    def _check_loop(self, trainer: pl.Trainer) -> None:
        name = type(self).__name__
        if trainer.max_steps != -1:
            raise ValueError(
                f"{name} found Trainer(max_steps={trainer.max_steps}): expected max_steps=-1, because the ranks "
                "take different numbers of steps per epoch, so they would stop in different epochs and their "
                "epoch-end collectives would never match. Fix: train for max_epochs (and drop max_steps)."
            )
        interval = trainer.val_check_interval
        if not (isinstance(interval, float) and interval == 1.0) or trainer.check_val_every_n_epoch is None:
            raise ValueError(
                f"{name} found Trainer(val_check_interval={interval!r}, check_val_every_n_epoch="
                f"{trainer.check_val_every_n_epoch!r}): expected validation at epoch ends "
                "(val_check_interval=1.0 and check_val_every_n_epoch an integer), because the ranks count "
                "different batches and would validate at different times. Fix: validate every n epochs."
            )
        for callback in trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_train_steps", 0)
            if every:
                raise ValueError(
                    f"{name} found ModelCheckpoint(every_n_train_steps={every}): expected checkpoints at epoch "
                    "ends, because the ranks take different numbers of steps and saving is collective (and the "
                    "queue's position within an epoch is not saved). Fix: ModelCheckpoint(every_n_epochs=...)."
                )

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Configure the optimizers with a finite ``estimated_stepping_batches``.

        The dynamic loader has no length, for which Lightning estimates ``max_steps`` (-1), and
        LR schedules built from the estimate break. While ``configure_optimizers`` runs, the
        estimate sees the mean batches per worker and epoch; afterwards the loop's length is
        unknown again (a known length would end a fast worker's epoch at its "share").
        """
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
        self._warn_high_momentum()

    def _warn_high_momentum(self) -> None:
        # Asynchrony adds an implicit momentum of about 1 - 1/P (Mitliagkas et al. 2016); on top
        # of SGD's usual 0.9 the sum passes 1 and training diverges (the digits ResNet does at P=2).
        workers = self._num_workers
        if workers < 2:
            return
        implicit = 1.0 - 1.0 / workers
        for optimizer in self.optimizers:
            momenta = [float(g.get("momentum", g.get("betas", (0.0,))[0])) for g in optimizer.param_groups]
            if momenta and max(momenta) + implicit > 1.0:
                rank_zero_warn(
                    f"async with {workers} workers adds an implicit momentum of about {implicit:.2f} "
                    f"to the optimizer's {max(momenta):g} (Mitliagkas et al. 2016): together above 1, training "
                    f"often diverges. Lower it, e.g. SGD(momentum={max(0.0, 1.0 - implicit):g}), or the lr."
                )
                return

    @override
    def _start_servers(self) -> None:
        if self._members is None:
            super()._start_servers()
        else:
            self._members.start_servers()

    @override
    def _make_shard(
        self, shard_id: int, slices: Sequence[Slice], params: Sequence[Tensor], spec: OptimizerSpec
    ) -> AsyncParameterShard:
        return AsyncParameterShard(
            shard_id,
            slices,
            params,
            spec,
            self.world_size,
            staleness_lr=self.staleness_lr,
            timeout=self.ps_timeout,
        )

    @override
    def _make_client(self, params: Sequence[Tensor], plan: Sequence[Sequence[Slice]]) -> AsyncParameterServerClient:
        return AsyncParameterServerClient(self.global_rank, params, plan, timeout=self.ps_timeout)

    # -- data ----------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give the training loader a :class:`DynamicBatchSampler`; other loaders pass through."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        name = type(self).__name__
        if isinstance(dataloader, DevicePrefetcher):
            # the copy ahead wraps the loader rebuilt below; on CUDA it takes each batch one step
            # before Lightning does: one more batch drawn ahead of the step (the bound is checked at
            # the step, so nothing else changes)
            inner = self.process_dataloader(dataloader.loader)
            if dataloader.active and self._lease is not None:
                self._lease.prefetch += 1
            return DevicePrefetcher(inner, dataloader.device, non_blocking=dataloader.non_blocking)  # type: ignore[arg-type]
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
            raise TypeError(
                f"{name} found a training loader of type {type(dataloader).__qualname__}"
                f"{' over an IterableDataset' if isinstance(dataloader, DataLoader) else ''}: expected a "
                "torch DataLoader over a map-style dataset, because workers draw batch indices from a shared "
                "queue. Fix: return a DataLoader(dataset, batch_size=..., shuffle=...) from train_dataloader() "
                "(optionally in a DevicePrefetcher)."
            )
        plan = _plan_of(dataloader)
        if plan.num_batches < self._num_workers:
            raise ValueError(
                f"{name} found {plan.num_batches} training batches per epoch ({plan.num_samples} samples in "
                f"batches of {plan.batch_size}) for {self._num_workers} workers: expected at least one batch per "
                "worker, because a rank that trains on no batch skips the epoch-end validation its peers run. "
                "Fix: a smaller batch size, or fewer processes."
            )
        if self._members is not None and self._members.is_server:
            self._plan = plan
            return self._members.servers_loader(dataloader, plan)
        limit = trainer.limit_train_batches
        self._limit = limit if isinstance(limit, int) else None
        if isinstance(limit, int) and plan.num_batches < limit * self.world_size:
            raise ValueError(
                f"{name} found Trainer(limit_train_batches={limit}) with {self.world_size} processes and "
                f"{plan.num_batches} batches per epoch: expected at least {limit} x {self.world_size} = "
                f"{limit * self.world_size} batches, so that every rank reaches its limit (and validates). Fix: "
                f"limit_train_batches <= {plan.num_batches // self.world_size}."
            )
        self._plan = plan
        if self._lease is not None:
            # Lightning draws one batch ahead of its step, loader processes prefetch_factor each more
            workers = dataloader.num_workers
            self._lease.prefetch = 1 + (workers * (dataloader.prefetch_factor or 2) if workers > 0 else 0)
        sampler = DynamicBatchSampler(plan, self._draw, self._current_epoch, self._give_back)
        kwargs: dict[str, Any] = {}
        if dataloader.num_workers > 0:
            kwargs.update(
                prefetch_factor=dataloader.prefetch_factor,
                persistent_workers=dataloader.persistent_workers,
                worker_init_fn=dataloader.worker_init_fn,
                multiprocessing_context=dataloader.multiprocessing_context,
            )
        return DataLoader(
            dataloader.dataset,
            batch_sampler=sampler,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            timeout=dataloader.timeout,
            **kwargs,
        )

    def _current_epoch(self) -> int:
        trainer = self.trainer
        if trainer is None:
            return 0
        # the epoch being run (`current_epoch` counts completed ones, one less during the epoch end)
        return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]

    def _draw(self, epoch: int, plan: DataPlan) -> list[int] | None:
        """The next batch of the lease; runs in the training process (the sampler's ``next``)."""
        assert self._lease is not None
        batch = self._lease.next(epoch, plan, limit=self._limit, should_stop=self._told_to_stop)
        if batch is None:
            trainer = self.trainer
            if self._lease.stopped and trainer is not None:
                trainer.should_stop = True  # the chief ended the run: this loop ends with it
            return None
        self._drawn.append(batch)  # loaders keep the sampler's order: the steps train them in this order
        return batch.indices

    def _give_back(self) -> None:
        """Return the batches drawn from the lease that no step trained (the loop dropped them)."""
        if self._drawn and self._lease is not None:
            self._lease.give_back(list(self._drawn))
        self._drawn.clear()

    def _told_to_stop(self) -> bool:
        return bool(getattr(self.trainer, "received_sigterm", False))

    # -- steps ---------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Note the leased batch this step trains, admit the step under the bound, then step.

        The bound is applied here, where the step starts, not in the sampler (which runs ahead of
        the steps, by the loader's prefetch). When it held the step (or a refill) back, the slower
        workers pushed meanwhile: pull their updates first (with ``pull_every=1``), as a gated
        synchronous step would see them. A dedicated server trains nothing: its step's loss is a
        zero that needs no forward.
        """
        if self._fitting() and self._is_server_only():
            return torch.zeros((), device=self.root_device, requires_grad=True)
        if self._fitting() and self._drawn:
            batch = self._drawn.popleft()
            self._unpushed.append(batch)
            lease, client = self._lease, self.async_client
            if lease is not None and client is not None:
                with self._peer_watch():
                    gap = lease.admit(batch, self._step_clock, should_stop=self._told_to_stop)
                    if gap is not None:
                        self._gap_max = gap if self._gap_max is None else max(self._gap_max, gap)
                    if lease.take_held() and self.pull_every == 1:
                        client.pull()
        return super().training_step(*args, **kwargs)

    @property
    def _step_clock(self) -> int:
        """This worker's steps as the lease and the staleness bound count them: its pushes, plus
        the pushes its gradient scaler skipped."""
        client = self.async_client
        return (client.clock if client is not None else 0) + self._skipped_pushes

    @override
    def optimizer_step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Push/pull as ``"ps"`` does; a step the gradient scaler skipped still ends as a step.

        Under ``16-mixed`` a step whose gradients overflow (or whose loss is ``None``) never calls
        the optimizer's ``step``, so no push happens. It still counts for the lease and the bound:
        its batch is acked, the worker's clock advances (the others would otherwise wait for a
        push that never comes) and the epoch's last step still flushes.
        """
        self._stepped = False
        out = super().optimizer_step(optimizer, *args, **kwargs)
        if not self._stepped and self._fitting() and self.async_client is not None and not self._is_server_only():
            self._end_step(optimizer, skipped=True)
        return out

    @override
    def _push_pull(self, optimizer: Optimizer) -> None:
        self._stepped = True
        self._end_step(optimizer, skipped=False)

    def _end_step(self, optimizer: Optimizer, *, skipped: bool) -> None:
        """Accumulate, push, pull and tell the lease, after a step (``skipped``: its gradients are
        not pushed, nor accumulated)."""
        client = self.async_client
        assert client is not None
        if self._is_server_only():
            return  # the servers' steps follow the workers' pushes; nothing to push
        grads: list[Tensor | None] | None = None if skipped else [p.grad for p in client.params]
        self._local_steps += 1
        trainer = self.trainer
        flush = trainer is not None and is_last_batch(trainer)
        push_due = self._local_steps % self.push_every == 0 or flush
        pull_due = self._local_steps % self.pull_every == 0 or flush
        if self.push_every > 1:
            grads = self._accumulate(grads, take=push_due)
        if push_due:
            if grads is not None:
                lrs = [float(g["lr"]) for g in optimizer.param_groups]
                if self._lease is not None and self._lease.lrs is not None and self._members is not None:
                    lrs = self._lease.lrs  # dedicated servers: the chief's schedule, which follows the mean worker
                client.push(grads, lrs, pull=pull_due)
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
                # the epoch's clock and acks reach the coordinator before its end (with dedicated
                # servers, the buffers too: the chief validates and saves with the latest worker's)
                buffers = {"buffers": pack(self._buffers)} if self._members is not None and self._buffers else None
                self._lease.flush(publish=buffers)

    def _accumulate(self, grads: list[Tensor | None] | None, *, take: bool) -> list[Tensor | None] | None:
        """Add this step's gradients (``None``: a skipped step's, left out) to the local sums; when
        ``take``, return their mean (``None`` if every step was skipped) and reset."""
        if grads is not None:
            if not self._accumulated:
                self._accumulated = [None] * len(grads)
            for i, g in enumerate(grads):
                if g is None:
                    continue
                acc = self._accumulated[i]
                self._accumulated[i] = g.detach().clone() if acc is None else acc.add_(g.detach())
            self._accumulated_steps += 1
        if not take:
            return grads
        n = self._accumulated_steps
        if n == 0:
            return None
        mean = [a.div_(n) if a is not None else None for a in self._accumulated]
        self._accumulated, self._accumulated_steps = [], 0
        return mean

    @override
    def _collect_own_metrics(self, stats: CommStats) -> None:
        client = self.async_client
        assert client is not None
        if self._is_server_only():
            assert self._members is not None
            self.metrics.latest(**self._members.metrics())
            return
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

    # -- consistent points: validation, checkpoints, the end -----------------------------------

    def _pull_latest(self, reason: str, *, last: bool = False) -> None:
        """Barrier (every rank's pushes are applied), then the latest weights and rank 0's buffers.

        With ``last``, a second barrier keeps every shard up until every rank has pulled: the
        next step is teardown, which drops this rank's shard.
        """
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
    def on_train_start(self) -> None:
        super().on_train_start()
        members, trainer = self._members, self.trainer
        if members is not None and not members.is_server and trainer is not None:
            # a worker's loop runs until the chief ends the run: a lost worker's batches may come
            # after its last epoch, and a joined worker's loop epochs are not the run's
            trainer.fit_loop.max_epochs = -1

    @override
    def on_validation_start(self) -> None:
        if self._members is not None:
            self._members.pull_latest()  # the chief, once the epoch's every batch is pushed
        else:
            self._pull_latest("async_validation")
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        if self._members is not None:
            self._members.train_end()
            super().on_train_end()  # the chief gathers the shards' optimizer state here
            self._members.after_train_end()
            return
        self._pull_latest("async_train_end", last=True)
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The latest weights: every rank calls this from ``Trainer.save_checkpoint``, before the
        optimizer state is gathered, so after the barrier the shards hold every push. With
        dedicated servers only the chief writes, at an epoch's end (every batch pushed)."""
        if self._members is not None:
            if self._members.is_chief and self._fitting():
                self._members.pull_latest()
        else:
            self._pull_latest("async_checkpoint")
        return super().lightning_module_state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Fail the refills that wait on this worker's clock at once (the bound would wait ``timeout``)."""
        if self._rpc_started and self._fitting():
            reason = f"{type(exception).__name__}: {exception}"
            report_failure(self.global_rank, reason, coordinator_rank=_COORDINATOR_RANK)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._members is not None:
            self._members.teardown()  # before the coordinator goes: the membership monitor uses it
        if self._coordinator is not None:
            unregister_coordinator()
            self._coordinator.shutdown()
            self._coordinator = None
        self._lease = None
        self._drawn.clear()
        self._unpushed = []
        self._accumulated = []
        self._staleness_sum = self._staleness_count = 0
        super().teardown()


def _check_options(
    max_staleness: int | None, push_every: int, pull_every: int, timeout: object, staleness_lr: str, lease: int
) -> None:
    name = "AsyncParameterServerStrategy"
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


def _check_dedicated(dedicated: bool, start_method: str) -> None:
    if dedicated and start_method != "popen":
        raise ValueError(
            f"AsyncParameterServerStrategy(dedicated_servers=True, start_method={start_method!r}): Lightning's "
            f"{start_method!r} launcher ends every process when one dies, which dedicated servers are there to "
            "survive. Expected processes started independently (torchrun, SLURM, by hand) or "
            "start_method='popen'. Fix: pass start_method='popen' (the default)."
        )


def _plan_of(dataloader: DataLoader) -> DataPlan:
    """The batching of ``dataloader`` as a :class:`DataPlan` (its sampler decides shuffle and seed)."""
    sampler = dataloader.sampler
    batch_size = dataloader.batch_size
    drop_last = dataloader.drop_last
    if batch_size is None:  # a custom batch sampler
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
        drop_last = bool(getattr(dataloader.batch_sampler, "drop_last", False))
        sampler = getattr(dataloader.batch_sampler, "sampler", sampler)
    if not isinstance(batch_size, int):
        raise TypeError(
            f"AsyncParameterServerStrategy could not find the batch size of the training DataLoader (batch "
            f"sampler {type(dataloader.batch_sampler).__qualname__}): expected DataLoader(batch_size=...) or a "
            "batch sampler with a `batch_size`. Fix: pass batch_size to the DataLoader."
        )
    shuffle = isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))
    seed = int(sampler.seed) if isinstance(sampler, DistributedSampler) else 0
    return DataPlan(len(dataloader.dataset), batch_size, drop_last, shuffle, seed)  # type: ignore[arg-type]


def _without_per_step_collective(trainer: pl.Trainer) -> None:
    """Replace the training loop's per-step SIGTERM broadcast by a local check.

    Lightning broadcasts a SIGTERM flag from rank 0 before every training step; with ranks
    taking different numbers of steps that broadcast would pair with a peer's epoch-end
    collective. Each rank still stops on its own SIGTERM.
    """
    epoch_loop = trainer.fit_loop.epoch_loop

    def check_sigterm() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    epoch_loop._broadcast_sigterm_tensor = check_sigterm  # type: ignore[method-assign]
