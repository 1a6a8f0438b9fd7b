"""Elastic training: joining the process group again after a torchrun restart, and the pieces of
asynchronous training with dedicated servers whose workers come and go.

**After a torchrun restart.** torch 2.14's workers share the elastic agent's TCP store across
restarts (``MASTER_PORT`` is the same in every attempt) and key it only by group name, so a
restarted rank can read the
*dead* attempt's gloo addresses before its peers overwrite them and fail with "Gloo
connectFullMesh failed ... Connection refused" (pytorch/pytorch#167288 looks like the same
with NCCL; older torch prefixed ``/worker/attempt_<n>`` itself). Our strategies join through a
store prefixed by the attempt number instead; Lightning then finds the group initialised and
leaves it alone.

**Dedicated servers** (``AsyncParameterServerStrategy(dedicated_servers=True)``; the membership
itself is :mod:`lightning_strategies.comm.elastic`): :class:`ElasticScriptLauncher` (Lightning's
``popen`` launcher without the observer that kills every process when one dies) and
:class:`ServersSampler` (the servers' training loop, which follows the workers' progress).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.utils.data import Sampler
from typing_extensions import override

from lightning_strategies.comm.coordinator import AsyncCoordinator, DataPlan, JoinReply, _rpc_run_state
from lightning_strategies.comm.elastic import (
    MembershipMonitor,
    connect_store,
    evict,
    init_member_rpc,
    load_server_values,
    mark_evicted,
    next_incarnation,
    run_prefix,
)
from lightning_strategies.comm.heartbeat import DEFAULT_STORE_TIMEOUT, Heartbeat
from lightning_strategies.comm.lease import BatchLease, fetch_published, join_run, leave_run
from lightning_strategies.comm.ps import Packed, pack, slice_of, unpack
from lightning_strategies.comm.rpc import register_coordinator, register_shard, shutdown_rpc, worker_name

log = logging.getLogger(__name__)

#: Seconds between two heartbeats of a member of a run with dedicated servers (and between two
#: reads of them on the chief): a lost worker's batches wait for its drop, so it is noticed fast.
MEMBERSHIP_INTERVAL = 0.5
#: Seconds of silence before the chief pings a member. Short, because the ping decides: a live
#: member answers it (it is only slow), a killed one refuses at once, a frozen one never answers.
MEMBERSHIP_GRACE = 1.0

__all__ = [
    "MEMBERSHIP_GRACE",
    "MEMBERSHIP_INTERVAL",
    "DedicatedServers",
    "ElasticRestartMixin",
    "ElasticScriptLauncher",
    "ServersSampler",
    "join_restarted_process_group",
]


def join_restarted_process_group(backend: str, timeout: timedelta | None) -> bool:
    """Initialise the default process group through a per-attempt store after a torchrun restart.

    A no-op (returning False) outside torchrun, in the first attempt, when torchrun does not
    share its agent's store, or when a group exists already.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: the process-group timeout (also used to reach the store).

    Returns:
        Whether this call initialised the group.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    timeout = timeout or timedelta(minutes=30)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"/worker/attempt_{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return True


class ElasticRestartMixin(DDPStrategy):
    """Put before ``DDPStrategy`` (or a subclass) in the bases: after a torchrun restart the
    process group is joined through a per-attempt store (:func:`join_restarted_process_group`)."""

    @override
    def setup_distributed(self) -> None:
        join_restarted_process_group(self._get_process_group_backend(), self._timeout)
        super().setup_distributed()


# --------------------------------------------------------------------------------------------
# Asynchronous training with dedicated servers: members that come and go
# --------------------------------------------------------------------------------------------


class ElasticScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher without its child-process observer.

    The observer SIGKILLs every process as soon as one child exits with an error: right for a
    synchronous run, wrong for one whose point is to go on without a lost worker.
    """

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class ServersSampler(Sampler[list[int]]):
    """The training loop of a dedicated server: it trains nothing and follows the workers.

    Each epoch yields ``steps`` marker batches (the mean batches per worker), the ``j``-th once
    the workers have pushed ``j/steps`` of the epoch's batches, and ends once they have pushed
    them all, so the server's global step and LR schedule follow the mean worker's and its epoch
    end (validation, checkpoint) sees every batch in. The first marker needs no wait: Lightning
    draws it while the strategy is being set up. The chief opens the epoch first (the workers
    lease from then on).

    Args:
        plan: the epoch's batching.
        steps: marker batches per epoch.
        epoch: returns the epoch being run.
        open_epoch: called once per epoch before the first marker.
        wait: ``wait(epoch, batches_done)`` blocks until that many batches are pushed; False: the
            run is over.
    """

    def __init__(
        self,
        plan: DataPlan,
        steps: int,
        epoch: Callable[[], int],
        open_epoch: Callable[[int], None],
        wait: Callable[[int, int], bool],
    ) -> None:
        self.plan = plan
        self.steps = max(1, steps)
        self._epoch = epoch
        self._open = open_epoch
        self._wait = wait

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._epoch()
        self._open(epoch)
        total = self.plan.num_batches
        for j in range(self.steps):
            if j and not self._wait(epoch, math.ceil(j * total / self.steps)):
                return
            yield [j % max(1, self.plan.num_samples)]  # a real sample: the step never reads it
        self._wait(epoch, total)


class DedicatedServers:
    """What ``AsyncParameterServerStrategy(dedicated_servers=True)`` does differently.

    Ranks ``0 .. num_servers-1`` serve the shards and do not train; rank 0, the *chief*, also
    serves the job's store and the coordinator, validates, writes the checkpoints and logs the
    run's membership. The other ranks are workers, which may be lost and may join (see
    :mod:`lightning_strategies.comm.elastic`). Each process has a process group of its own (one
    rank), so none of Lightning's collectives (barriers, ``broadcast``, ``reduce`` of logged
    metrics, torchmetrics' syncs, the checkpoint barrier, the end-of-fit teardown) pairs a process
    with another that may be gone; everything between processes goes over RPC and the store.

    The strategy calls these methods from its hooks; they read and set its state.
    """

    def __init__(self, strategy: Any, num_servers: int) -> None:
        self.strategy = strategy
        self.num_servers = num_servers
        self.store: dist.Store | None = None
        self._tcp: dist.TCPStore | None = None
        self.incarnation = 0
        self.name = ""
        self.monitor: MembershipMonitor | None = None
        self.join: JoinReply | None = None
        self._evictions: list[threading.Thread] = []
        self._pg = False
        self._left = False

    # -- roles ----------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return int(self.strategy.global_rank)

    @property
    def world(self) -> int:
        return int(self.strategy.num_nodes * self.strategy.num_processes)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def is_server(self) -> bool:
        return self.rank < self.num_servers

    @property
    def workers(self) -> list[int]:
        return list(range(self.num_servers, self.world))

    @property
    def timeout(self) -> timedelta:
        return self.strategy.ps_timeout

    @property
    def startup(self) -> timedelta:
        """How long a process waits for the others to start (the store, shards, coordinator): the
        ranks of a job may start minutes apart, so at least 5 minutes, whatever ``timeout`` is."""
        return max(self.timeout, timedelta(minutes=5))

    @property
    def coordinator(self) -> AsyncCoordinator | None:
        return self.strategy._coordinator

    def _store(self) -> dist.Store:
        assert self.store is not None, "the job's store is not connected yet (setup_distributed)"
        return self.store

    # -- environment ----------------------------------------------------------------------------

    def check_world(self) -> None:
        if self.num_servers >= self.world:
            raise ValueError(
                f"AsyncParameterServerStrategy(dedicated_servers=True, num_servers={self.num_servers}) with "
                f"{self.world} processes: expected at least one worker besides the servers. Fix: start more "
                f"processes, or pass num_servers < {self.world}."
            )

    def connect(self) -> None:
        """Connect to the job's store (rank 0 serves it), take this start's incarnation, and give
        the process a process group of its own (one rank). Outside of fitting (``test`` after
        ``fit``) only the process group: each process evaluates its own weights, alone."""
        self.check_world()
        self.join, self._left = None, False
        if not self.strategy._fitting():
            self._init_own_group()
            return
        env = self.strategy.cluster_environment
        self.store, self._tcp = connect_store(env.main_address, env.main_port, self.rank, timeout=self.startup)
        self.incarnation = next_incarnation(self.store, self.rank)
        if self.is_server and self.incarnation > 0:
            raise RuntimeError(
                f"async: server rank {self.rank} was started again (incarnation {self.incarnation}), but servers "
                "are not replicated: its shard's updates since the last checkpoint are lost. Expected only "
                "workers to restart. Fix: restart the whole run with resume= from the last checkpoint."
            )
        self._init_own_group()

    def _init_own_group(self) -> None:
        if not dist.is_initialized():
            backend = self.strategy._get_process_group_backend()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
            self._pg = True

    def start_rpc(self) -> None:
        """This process's membership of the RPC group, then its heartbeat in the job's store.

        The heartbeat starts after the join: a relaunched worker beats in its rank's slot, and
        the chief must first see the old incarnation silent (and evict it) for the join to go through.
        """
        strategy = self.strategy
        beat = strategy._peer_heartbeat
        if beat is not None:
            beat.stop(finished=False)  # the one-rank process group's store reaches no peer
            strategy._peer_heartbeat = None
        if self.store is None:
            return  # not fitting: no peers
        store, tcp = self._store(), self._tcp
        assert tcp is not None
        device_maps = None
        if strategy.root_device.type == "cuda":
            # TensorPipe moves CUDA tensors directly once told which device each server uses
            store.set(f"device/{self.rank}", str(strategy.root_device))
            if not self.is_server:
                store.wait([f"device/{s}" for s in range(self.num_servers)], self.startup)
                device_maps = {
                    worker_name(s): {strategy.root_device: torch.device(store.get(f"device/{s}").decode())}
                    for s in range(self.num_servers)
                }
        self.name = init_member_rpc(
            store,
            lambda: dist.PrefixStore(run_prefix(), tcp.clone()),
            self.rank,
            self.incarnation,
            self.world,
            timeout=self.timeout,
            num_threads=strategy._rpc_threads,
            device_maps=device_maps,
        )
        strategy._rpc_started = True
        clone = tcp.clone()  # a connection of its own, with a short timeout (as start_heartbeat's)
        clone.set_timeout(DEFAULT_STORE_TIMEOUT)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        strategy._peer_heartbeat = Heartbeat(
            dist.PrefixStore(run_prefix(), clone),
            self.rank,
            self.world,
            interval=MEMBERSHIP_INTERVAL,
            store_host=f"{tcp.host}:{tcp.port}",
            store_rank=None if agent else 0,
        ).start()

    # -- setup ----------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        """The chief hosts the coordinator and watches the members; workers get their lease;
        only the chief validates."""
        strategy = self.strategy
        limit = trainer.limit_train_batches
        if not (isinstance(limit, float) and limit == 1.0):
            raise ValueError(
                f"AsyncParameterServerStrategy(dedicated_servers=True) found Trainer(limit_train_batches={limit!r}): "
                "expected 1.0, because the epoch ends when its every batch is pushed, whoever trains it. "
                "Fix: train on a smaller dataset (a Subset) instead of limiting the batches."
            )
        store = self._store()
        if self.is_chief:
            coordinator = AsyncCoordinator(
                self.workers,
                strategy.max_staleness,
                timeout=self.timeout,
                push_every=strategy.push_every,
                elastic=True,
            )
            coordinator.on_drop = self._on_drop
            strategy._coordinator = coordinator
            register_coordinator(coordinator)
            self.monitor = MembershipMonitor(
                strategy._peer_heartbeat,
                workers=self.workers,
                servers=list(range(1, self.num_servers)),
                name_of=lambda r: coordinator.name_of(r) or worker_name(r),
                alive=lambda: coordinator.alive,
                joined=coordinator.joined,
                drop=coordinator.drop,
                fail=self._server_lost,
                timeout=self.timeout,
                interval=MEMBERSHIP_INTERVAL,
                grace=MEMBERSHIP_GRACE,
            ).start()
            store.set("coordinator_ready", "1")
        else:
            store.wait(["coordinator_ready"], self.startup)
            trainer.limit_val_batches = 0  # the chief validates, on the whole validation set
            trainer.num_sanity_val_steps = 0
        if not self.is_server:
            lease = strategy._lease = BatchLease(
                self.rank,
                coordinator_rank=0,
                rpc_timeout=strategy._rpc_timeout,
                lease=strategy.lease,
                max_staleness=strategy.max_staleness,
                incarnation=self.incarnation,
            )
            # joined before its first lease, which Lightning draws while the optimizers are set up
            self.join = join_run(
                self.rank, self.incarnation, self.name, coordinator_rank=0, rpc_timeout=strategy._rpc_timeout
            )
            lease.offset = self.join.offset
            if self.join.lrs is not None:
                lease.lrs = self.join.lrs

    def _on_drop(self, rank: int, incarnation: int, name: str, reason: str) -> None:
        log.warning(f"async: worker rank {rank} (incarnation {incarnation}) dropped: {reason}; its batches are redrawn")
        if self.monitor is not None:
            self.monitor.forget(rank)
        # out of the RPC group, so that a relaunched worker can join (off the caller's thread: an
        # RPC thread or the monitor)
        def out_of_the_group() -> None:
            evict(name or worker_name(rank))
            mark_evicted(self._store(), rank, incarnation)

        thread = threading.Thread(target=out_of_the_group, name=f"async-evict-{rank}")
        thread.daemon = True
        thread.start()
        self._evictions.append(thread)

    def _server_lost(self, rank: int, reason: str) -> None:
        coordinator = self.coordinator
        if coordinator is not None:
            coordinator.abort(
                f"server rank {rank} is lost ({reason}); servers are not replicated, so the run stops. Fix: restart "
                "the run with resume= from the last checkpoint."
            )

    def start_servers(self) -> None:
        """The servers register their shards (the chief's weights in every one), then every
        process gets its client; a worker pulls the current weights and joins the coordinator."""
        from lightning_strategies.strategies.parameter_server import _ServerStepOptimizer  # imports this module

        strategy = self.strategy
        store = self._store()
        _, spec, params, plan = strategy._plan_servers()
        optimizer = strategy.optimizers[0]
        wait = self.startup
        if self.is_server:
            mine = plan[self.rank]
            values = [slice_of(params[sl.tensor], sl) for sl in mine]
            register_shard(strategy._make_shard(self.rank, mine, values, spec))
            store.set(f"shard_ready/{self.rank}", "1")
        store.wait([f"shard_ready/{k}" for k in range(self.num_servers)], wait)
        strategy._client = strategy._make_client(params, plan)
        strategy._server_step = _ServerStepOptimizer(optimizer, strategy._push_pull)
        assert strategy.model is not None
        strategy._buffers = list(strategy.model.buffers())
        rpc_timeout = strategy._rpc_timeout
        if self.is_chief:
            # every shard starts from the chief's weights (its initialisation, or the checkpoint)
            futures = [
                load_server_values(k, worker_name(k), pack([slice_of(params[sl.tensor], sl) for sl in plan[k]]),
                                   timeout=rpc_timeout)
                for k in range(1, self.num_servers)
            ]  # fmt: skip
            for fut in futures:
                fut.wait()
            if strategy._buffers:
                assert self.coordinator is not None
                self.coordinator.publish(buffers=pack(strategy._buffers))
            store.set("ps_ready", "1")
        else:
            store.wait(["ps_ready"], wait)
        if not self.is_server:
            strategy._client.pull()  # the current weights (a joining worker's first step is on them)
            self._load_buffers(
                fetch_published("buffers", coordinator_rank=0, worker=self.rank, rpc_timeout=rpc_timeout)
            )

    def _load_buffers(self, packed: Packed | None) -> None:
        buffers = self.strategy._buffers
        if packed is None or not buffers:
            return
        with torch.no_grad():
            for b, v in zip(buffers, unpack(packed, buffers), strict=True):
                if v is not None:
                    b.copy_(v.reshape(b.shape))

    # -- the servers' loop ----------------------------------------------------------------------

    def servers_loader(self, dataloader: Any, plan: DataPlan) -> Any:
        """The servers' training loader: marker batches that follow the workers' progress."""
        from torch.utils.data import DataLoader

        steps = math.ceil(plan.num_batches / len(self.workers))
        sampler = ServersSampler(plan, steps, self.strategy._current_epoch, self._open, self._wait)
        return DataLoader(dataloader.dataset, batch_sampler=sampler, collate_fn=dataloader.collate_fn)

    def _open(self, epoch: int) -> None:
        coordinator = self.coordinator
        if coordinator is not None:
            self._publish_lrs()
            plan = self.strategy._plan
            assert plan is not None
            coordinator.open_epoch(epoch, plan)

    def _publish_lrs(self) -> None:
        coordinator = self.coordinator
        if coordinator is not None and self.strategy.optimizers:
            coordinator.set_lrs([float(g["lr"]) for g in self.strategy.optimizers[0].param_groups])

    def _wait(self, epoch: int, at_least: int) -> bool:
        """Block until ``at_least`` of the epoch's batches are pushed; False: the run is over."""
        coordinator = self.coordinator
        seconds = self.timeout.total_seconds()
        if coordinator is not None:  # the chief
            self._publish_lrs()  # the LR schedule's step since the last marker reaches the workers
            coordinator.wait_done(epoch, at_least, timeout=seconds, should_stop=self.strategy._told_to_stop)
            return not coordinator.stopped
        while True:  # another server: the chief's coordinator, polled
            done, complete, stopped, _ = rpc.rpc_sync(worker_name(0), _rpc_run_state, args=(epoch,), timeout=seconds)
            if stopped:
                return False
            if complete or done >= at_least:
                return True
            if self.strategy._told_to_stop():
                raise RuntimeError(f"async server rank {self.rank}: told to stop while following epoch {epoch}")
            time.sleep(0.25)

    # -- consistent points ----------------------------------------------------------------------

    def pull_latest(self) -> None:
        """The shards' latest weights and the latest buffers a worker reported."""
        client = self.strategy.async_client
        if client is None:
            return
        client.pull()
        coordinator = self.coordinator
        if coordinator is not None:
            self._load_buffers(coordinator.published("buffers"))
        else:
            self._load_buffers(
                fetch_published("buffers", coordinator_rank=0, worker=self.rank, rpc_timeout=self.strategy._rpc_timeout)
            )

    def train_end(self) -> None:
        """The chief ends the run and waits for the workers to take the last weights and leave;
        a worker takes them and leaves; the other servers wait for the chief's word
        (:meth:`after_train_end`)."""
        strategy = self.strategy
        deadline = time.monotonic() + self.timeout.total_seconds()
        store = self._store()
        coordinator = self.coordinator
        if self.is_chief and coordinator is not None:
            coordinator.close()
            while not coordinator.left_or_lost() and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        if self.is_server:
            # the chief gathers every shard's optimizer state after this (for a save after fit):
            # this server's shard stays up until then
            store.wait(["chief_done"], self.timeout)
            return
        if strategy.async_client is not None:
            self.pull_latest()
            self._leave()

    def _leave(self) -> None:
        if self.join is not None and not self._left:
            self._left = True
            leave_run(self.rank, self.incarnation, coordinator_rank=0, rpc_timeout=self.strategy._rpc_timeout)
            beat = self.strategy._peer_heartbeat
            if beat is not None:  # done: no beat may reach the store after the chief closes it
                beat.stop()
                self.strategy._peer_heartbeat = None

    def after_train_end(self) -> None:
        """The chief has gathered what it keeps of the shards: the other servers may go."""
        if self.is_chief and self.store is not None:
            self.store.set("chief_done", "1")

    # -- metrics and shutdown -------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The run's membership, as the chief logs it."""
        coordinator = self.coordinator
        if coordinator is None:
            return {}
        return {
            "async/workers_alive": float(len(coordinator.alive)),
            "async/workers_lost": float(coordinator.workers_lost),
            "async/workers_joined": float(coordinator.workers_joined),
            "async/batches_redrawn": float(coordinator.batches_redrawn),
        }

    def teardown(self) -> None:
        """Stop watching, leave the RPC group without a graceful leave (it would ask every member,
        the dead too), and drop the one-rank process group."""
        if not self.is_server and not self.strategy.failed and self.store is not None:
            with contextlib.suppress(Exception):  # a fit whose loop never ran (joined after the last batch)
                self._leave()
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        for thread in self._evictions:
            thread.join(timeout=10.0)
        self._evictions = []
        strategy = self.strategy
        if strategy._peer_heartbeat is not None:  # before its store closes: a beat after that fails in C++,
            strategy._peer_heartbeat.stop()  # which prints a stack trace at the end of a clean run
            strategy._peer_heartbeat = None
        if strategy._rpc_started:
            strategy._rpc_started = False
            shutdown_rpc(failed=True, timeout=self.timeout, grace_seconds=0.5)
        if self._pg and dist.is_initialized():
            dist.destroy_process_group()
        self._pg = False
        self.store = self._tcp = None
