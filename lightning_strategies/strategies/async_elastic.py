"""``AsyncElasticStrategy`` ("async_elastic"): ``"async"`` with dedicated servers, whose workers may be lost and rejoin.

Each process has a process group of its own, so no Lightning collective pairs it with one that may be gone:
everything between processes goes over RPC and the store (:mod:`lightning_strategies.comm.elastic`). The hooks
changed relative to ``"async"`` are:

- ``_configure_launcher``: :class:`ElasticScriptLauncher` (``popen`` without the observer that kills all if one dies).
- ``setup_distributed`` / ``_start_rpc``: the job's store, this start's incarnation, a one-rank process group,
  a join of the dynamic RPC group, the member heartbeat.
- ``distributed_sampler_kwargs`` / ``barrier`` / ``reduce_boolean_decision``: nothing spans processes.
- ``setup`` (``_start_coordination``) / ``_start_servers``: the coordinator and the membership monitor on the
  chief, the shards from the chief's weights, a lease and a join on each worker.
- ``process_dataloader``: the servers' loop follows the workers' pushes (:class:`ServersSampler`).
- ``training_step`` / ``_end_step`` / ``_collect_own_metrics``: a server trains nothing and logs the
  membership; a worker pushes with the chief's learning rates and publishes its buffers.
- ``on_train_start`` / ``_pull_latest`` / ``on_train_end`` / ``teardown``: a worker's loop runs until the chief
  ends the run; the chief's consistent points; leave without a graceful RPC shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from lightning_strategies.comm.async_ import (
    AsyncCoordinator,
    DataPlan,
    JoinReply,
    fetch_published,
    join_run,
    leave_run,
    register_coordinator,
)
from lightning_strategies.comm.async_.endpoints import _rpc_run_state
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
from lightning_strategies.comm.ps import Packed, pack, register_shard, slice_of, unpack
from lightning_strategies.comm.rpc import call_host, shutdown_rpc, worker_name
from lightning_strategies.strategies._base import exposed
from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy

__all__ = [
    "MEMBERSHIP_GRACE",
    "MEMBERSHIP_INTERVAL",
    "AsyncElasticStrategy",
    "DedicatedServers",
    "ElasticScriptLauncher",
    "ServersSampler",
]

log = logging.getLogger(__name__)

#: Seconds between a member's heartbeats (and the chief's reads of them): a lost worker's batches wait for its drop.
MEMBERSHIP_INTERVAL = 0.5
#: Seconds of silence before the chief pings a member. Short, because the ping decides: a live
#: member answers it (it is only slow), a killed one refuses at once, a frozen one never answers.
MEMBERSHIP_GRACE = 1.0


class ElasticScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher without its observer, which SIGKILLs every process once a child fails."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


@dataclass(eq=False)
class ServersSampler(Sampler[list[int]]):
    """A dedicated server's training loop: ``steps`` markers an epoch (the mean batches per worker), each once the
    workers have pushed that share of the epoch's batches, so the server's step and LR schedule follow the mean
    worker's. ``wait(epoch, batches_done)`` blocks (False: the run is over); the first marker, drawn during
    setup, is not waited for."""

    plan: DataPlan
    steps: int
    epoch: Callable[[], int]
    open_epoch: Callable[[int], None]
    wait: Callable[[int, int], bool]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, total, steps = self.epoch(), self.plan.num_batches, max(1, self.steps)
        self.open_epoch(epoch)
        for j in range(steps):
            if j and not self.wait(epoch, math.ceil(j * total / steps)):
                return
            yield [j % max(1, self.plan.num_samples)]  # a real sample: the step never reads it
        self.wait(epoch, total)


class DedicatedServers:
    """One process's membership of a run whose ranks ``0 .. num_servers-1`` serve the shards: the job's store,
    this start's incarnation and RPC name, its join, and on the chief the monitor and the evictions."""

    def __init__(self, num_servers: int) -> None:
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

    def check_world(self, world: int) -> None:
        if self.num_servers >= world:
            raise ValueError(
                f"AsyncElasticStrategy(num_servers={self.num_servers}) with {world} processes: expected at least "
                f"one worker besides the servers. Fix: start more processes, or pass num_servers < {world}."
            )

    def connected_store(self) -> dist.Store:
        assert self.store is not None, "the job's store is not connected yet (setup_distributed)"
        return self.store

    def connect(self, rank: int, address: str, port: int, *, backend: str, timeout: timedelta,
                startup: timedelta) -> None:  # fmt: skip
        """Connect to the job's store (rank 0 serves it), take this start's incarnation, make a one-rank group."""
        self.store, self._tcp = connect_store(address, port, rank, timeout=startup)
        self.incarnation = next_incarnation(self.store, rank)
        if rank < self.num_servers and self.incarnation > 0:
            raise RuntimeError(
                f"async: server rank {rank} was started again (incarnation {self.incarnation}), but servers "
                "are not replicated: its shard's updates since the last checkpoint are lost. Expected only "
                "workers to restart. Fix: restart the whole run with resume= from the last checkpoint."
            )
        self.own_group(backend, timeout)

    def own_group(self, backend: str, timeout: timedelta) -> None:
        """A one-rank default process group: Lightning then finds it initialised."""
        self.join, self._left = None, False
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            self._pg = True

    def join_rpc(self, rank: int, world: int, *, device: torch.device, num_threads: int, timeout: timedelta,
                 startup: timedelta) -> Heartbeat:  # fmt: skip
        """Join the run's RPC group, then beat in the job's store (after the join: a relaunch beats
        in its rank's slot, where the chief must first see the old incarnation silent)."""
        store, tcp = self.connected_store(), self._tcp
        assert tcp is not None
        device_maps: Mapping[str, Mapping[torch.device, torch.device]] | None = None
        if device.type == "cuda":
            # TensorPipe moves CUDA tensors directly once told which device each server uses
            store.set(f"device/{rank}", str(device))
            if rank >= self.num_servers:
                store.wait([f"device/{s}" for s in range(self.num_servers)], startup)
                device_maps = {
                    worker_name(s): {device: torch.device(store.get(f"device/{s}").decode())}
                    for s in range(self.num_servers)
                }
        self.name = init_member_rpc(
            store,
            lambda: dist.PrefixStore(run_prefix(), tcp.clone()),
            rank,
            self.incarnation,
            world,
            timeout=timeout,
            num_threads=num_threads,
            device_maps=device_maps,
        )
        clone = tcp.clone()  # a connection of its own, with a short timeout (as start_heartbeat's)
        clone.set_timeout(DEFAULT_STORE_TIMEOUT)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return Heartbeat(
            dist.PrefixStore(run_prefix(), clone),
            rank,
            world,
            interval=MEMBERSHIP_INTERVAL,
            store_host=f"{tcp.host}:{tcp.port}",
            store_rank=None if agent else 0,
        ).start()

    def evict_later(self, rank: int, incarnation: int, name: str) -> None:
        """Take a dropped worker out of the RPC group, so a relaunch can join (off the caller's thread)."""
        if self.monitor is not None:
            self.monitor.forget(rank)
        store, tcp = self.connected_store(), self._tcp
        assert tcp is not None

        def out_of_the_group() -> None:
            evict(name or worker_name(rank), dist.PrefixStore("rpc", dist.PrefixStore(run_prefix(), tcp.clone())))
            mark_evicted(store, rank, incarnation)

        thread = threading.Thread(target=out_of_the_group, name=f"async-evict-{rank}", daemon=True)
        thread.start()
        self._evictions.append(thread)

    def leave(self, rank: int, rpc_timeout: float) -> bool:
        """Leave the run (once); returns whether this call left."""
        if self.join is None or self._left:
            return False
        self._left = True
        leave_run(rank, self.incarnation, coordinator_rank=0, rpc_timeout=rpc_timeout)
        return True

    def stop_watching(self) -> None:
        """Stop the monitor and wait for the evictions under way."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        for thread in self._evictions:
            thread.join(timeout=10.0)
        self._evictions = []

    def close(self) -> None:
        """Drop the one-rank process group and the store."""
        if self._pg and dist.is_initialized():
            dist.destroy_process_group()
        self._pg = False
        self.store = self._tcp = None


class AsyncElasticStrategy(AsyncParameterServerStrategy):
    """``"async"`` that survives its workers: dedicated servers, workers that come and go.

    A worker killed, frozen past ``timeout`` or preempted (SIGTERM) is dropped and its leased, unpushed batches
    are trained by the others (every batch of an epoch counted once); a worker started again with the same rank
    rejoins, pulls the current weights and trains. Rank 0, the *chief*, also hosts the job's store and the
    coordinator, validates on the whole validation set, writes the checkpoints and logs ``async/workers_alive``,
    ``async/workers_lost``, ``async/workers_joined`` and ``async/batches_redrawn``. The LR schedule runs on the
    chief (following the mean worker) and travels with the leases; BatchNorm statistics are the latest worker's.
    Servers are not replicated: a lost server fails every worker (naming it), and ``ckpt_path`` of the last
    checkpoint restores the shards exactly.

    Args:
        dedicated_servers: must be True.
        num_servers: server ranks (``0 .. num_servers-1``, which do not train), default 1.
        **kwargs: everything :class:`~lightning_strategies.AsyncParameterServerStrategy` takes; processes are
            started independently (torchrun, SLURM, by hand) or by ``start_method="popen"``.

    Raises:
        ValueError: ``dedicated_servers=False``, a fork/spawn launcher, or fewer processes than servers plus one
            worker; at setup ``limit_train_batches`` other than 1.0.
    """

    # workers join and leave one process at a time: never the node as the worker (flat on any number of nodes)
    hierarchical_push: ClassVar[bool] = False

    def __init__(self, *, dedicated_servers: bool = True, num_servers: int | None = None, **kwargs: Any) -> None:
        start_method = kwargs.get("start_method", "popen")
        if not dedicated_servers:
            raise ValueError(
                "AsyncElasticStrategy(dedicated_servers=False): expected True, since the dedicated servers are "
                "what it is. Fix: use AsyncParameterServerStrategy (strategy='async') for shared hosting."
            )
        if start_method != "popen":
            raise ValueError(
                f"AsyncElasticStrategy(start_method={start_method!r}): Lightning's {start_method!r} launcher ends "
                "every process when one dies, which dedicated servers are there to survive. Expected processes "
                "started independently (torchrun, SLURM, by hand) or start_method='popen'. Fix: pass "
                "start_method='popen' (the default)."
            )
        if kwargs.get("hierarchical"):
            raise ValueError(
                "AsyncElasticStrategy(hierarchical=True): expected None or False, because its workers come and go "
                "one process at a time while a node's push needs all of its processes at every step. Fix: drop "
                "hierarchical (every worker pushes to the servers), or use strategy='async' on several nodes."
            )
        super().__init__(num_servers=num_servers or 1, **kwargs)
        self.dedicated_servers = True
        self._members = DedicatedServers(self.num_servers)

    members: DedicatedServers = exposed("_members", "This process's membership of the run.")

    @property
    def is_chief(self) -> bool:
        return self.global_rank == 0

    @property
    def is_server(self) -> bool:
        return self.global_rank < self.num_servers

    @property
    def workers(self) -> list[int]:
        """The worker ranks."""
        return list(range(self.num_servers, self.num_nodes * self.num_processes))

    @property
    def _num_workers(self) -> int:
        return len(self.workers)

    @property
    def _startup(self) -> timedelta:
        # the ranks of a job may start minutes apart, so at least 5 minutes, whatever `timeout` is
        return max(self.ps_timeout, timedelta(minutes=5))

    def epoch_samples(self, epoch: int) -> int | None:
        """On the chief: the samples of epoch ``epoch``'s batches the workers have pushed so far
        (throughput is counted there; the servers train nothing), else ``None``."""
        coordinator, plan = self._coordinator, self._plan
        if coordinator is None or plan is None:
            return None
        done = coordinator.done_count(epoch)
        full = done if done < plan.num_batches or plan.drop_last else done - 1
        last = plan.num_samples - (plan.num_batches - 1) * plan.batch_size if full < done else 0
        return full * plan.batch_size + last

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None  # and start_method is "popen" (the constructor checks it)
        self._launcher = ElasticScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        world = self.num_nodes * self.num_processes
        self._members.check_world(world)
        backend = self._get_process_group_backend()
        if self._fitting():
            env = self.cluster_environment
            assert env is not None
            self._members.connect(self.global_rank, env.main_address, env.main_port, backend=backend,
                                  timeout=self.ps_timeout, startup=self._startup)  # fmt: skip
        else:  # `test` after `fit`: each process evaluates its own weights, alone
            self._members.own_group(backend, self.ps_timeout)
        super().setup_distributed()

    @override
    def _start_rpc(self) -> None:
        self._stop_heartbeat(finished=False)  # the one-rank process group's store reaches no peer
        if self._members.store is None:
            return  # not fitting: no peers
        self._peer_heartbeat = self._members.join_rpc(
            self.global_rank,
            self.num_nodes * self.num_processes,
            device=self.root_device,
            num_threads=self._rpc_threads,
            timeout=self.ps_timeout,
            startup=self._startup,
        )
        self._rpc_started = True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # the chief validates on the whole set; tests run per process

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """No process waits for another."""

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return bool(decision)  # each process decides for itself (the chief for the run)

    @override
    def _start_coordination(self, trainer: pl.Trainer) -> None:
        limit = trainer.limit_train_batches
        if not (isinstance(limit, float) and limit == 1.0):
            raise ValueError(
                f"AsyncElasticStrategy (strategy='async_elastic') found Trainer(limit_train_batches={limit!r}): "
                "expected 1.0, because the epoch ends when its every batch is pushed, whoever trains it. "
                "Fix: train on a smaller dataset (a Subset) instead of limiting the batches."
            )
        members, store = self._members, self._members.connected_store()
        if self.is_chief:
            coordinator = AsyncCoordinator(
                self.workers, self.max_staleness, timeout=self.ps_timeout, push_every=self.push_every, elastic=True
            )
            coordinator.on_drop = self._on_drop
            self._coordinator = coordinator
            register_coordinator(coordinator)
            assert self._peer_heartbeat is not None
            members.monitor = MembershipMonitor(
                self._peer_heartbeat,
                workers=self.workers,
                servers=list(range(1, self.num_servers)),
                name_of=lambda r: coordinator.name_of(r) or worker_name(r),
                alive=lambda: coordinator.alive,
                joined=coordinator.joined,
                drop=coordinator.drop,
                fail=self._server_lost,
                timeout=self.ps_timeout,
                interval=MEMBERSHIP_INTERVAL,
                grace=MEMBERSHIP_GRACE,
            ).start()
            store.set("coordinator_ready", "1")
        else:
            store.wait(["coordinator_ready"], self._startup)
            trainer.limit_val_batches = 0  # the chief validates, on the whole validation set
            trainer.num_sanity_val_steps = 0
        if not self.is_server:
            lease = self._lease = self._new_lease(members.incarnation)
            # joined before its first lease, which Lightning draws while the optimizers are set up
            members.join = join_run(
                self.global_rank, members.incarnation, members.name, coordinator_rank=0, rpc_timeout=self._rpc_timeout
            )
            lease.offset = members.join.offset
            if members.join.lrs is not None:
                lease.lrs = members.join.lrs

    def _on_drop(self, rank: int, incarnation: int, name: str, reason: str) -> None:
        log.warning(f"async: worker rank {rank} (incarnation {incarnation}) dropped: {reason}; its batches are redrawn")
        self._members.evict_later(rank, incarnation, name)

    def _server_lost(self, rank: int, reason: str) -> None:
        if self._coordinator is not None:
            self._coordinator.abort(
                f"server rank {rank} is lost ({reason}); servers are not replicated, so the run stops. Fix: restart "
                "the run with resume= from the last checkpoint."
            )

    @override
    def _start_servers(self) -> None:
        store = self._members.connected_store()
        _, spec, params, plan = self._plan_servers()
        rank = self.global_rank
        if self.is_server:
            mine = plan[rank]
            register_shard(self._make_shard(rank, mine, [slice_of(params[s.tensor], s) for s in mine], spec))
            store.set(f"shard_ready/{rank}", "1")
        store.wait([f"shard_ready/{k}" for k in range(self.num_servers)], self._startup)
        self._start_client(params, plan)
        if self.is_chief:
            # every shard starts from the chief's weights (its initialisation, or the checkpoint)
            futures = [
                load_server_values(k, worker_name(k), pack([slice_of(params[s.tensor], s) for s in plan[k]]),
                                   timeout=self._rpc_timeout)
                for k in range(1, self.num_servers)
            ]  # fmt: skip
            for fut in futures:
                fut.wait()
            if self._buffers:
                assert self._coordinator is not None
                self._coordinator.publish(buffers=pack(self._buffers))
            store.set("ps_ready", "1")
        else:
            store.wait(["ps_ready"], self._startup)
        if not self.is_server:
            self._pull_members()  # the current weights (a joining worker's first step is on them)

    @override
    def _training_loader(self, dataloader: DataLoader, plan: DataPlan) -> object:
        if not self.is_server:
            return super()._training_loader(dataloader, plan)
        self._plan = plan
        steps = math.ceil(plan.num_batches / self._num_workers)
        sampler = ServersSampler(plan, steps, self._current_epoch, self._open, self._wait)
        return DataLoader(dataloader.dataset, batch_sampler=sampler, collate_fn=dataloader.collate_fn)

    def _open(self, epoch: int) -> None:
        if self._coordinator is not None:
            self._publish_lrs()
            assert self._plan is not None
            self._coordinator.open_epoch(epoch, self._plan)

    def _publish_lrs(self) -> None:
        if self._coordinator is not None and self.optimizers:
            self._coordinator.set_lrs([float(g["lr"]) for g in self.optimizers[0].param_groups])

    def _wait(self, epoch: int, at_least: int) -> bool:
        """Block until ``at_least`` of the epoch's batches are pushed; False: the run is over."""
        seconds = self.ps_timeout.total_seconds()
        if self._coordinator is not None:  # the chief
            self._publish_lrs()  # the LR schedule's step since the last marker reaches the workers
            self._coordinator.wait_done(epoch, at_least, timeout=seconds, should_stop=self._told_to_stop)
            return not self._coordinator.stopped
        while True:  # another server: the chief's coordinator, polled
            done, complete, stopped, _ = call_host(0, _rpc_run_state, epoch, local=False, timeout=seconds).wait()
            if stopped:
                return False
            if complete or done >= at_least:
                return True
            if self._told_to_stop():
                raise RuntimeError(f"async server rank {self.global_rank}: told to stop while following epoch {epoch}")
            time.sleep(0.25)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._fitting() and self.is_server:
            return torch.zeros((), device=self.root_device, requires_grad=True)  # no forward needed
        return super().training_step(*args, **kwargs)

    @override
    def _end_step(self, optimizer: Optimizer, *, skipped: bool) -> None:
        if not self.is_server:  # the servers' steps follow the workers' pushes
            super()._end_step(optimizer, skipped=skipped)

    @override
    def _push_lrs(self, optimizer: Optimizer) -> list[float]:
        if self._lease is not None and self._lease.lrs is not None:
            return self._lease.lrs  # the chief's schedule, which follows the mean worker
        return super()._push_lrs(optimizer)

    @override
    def _epoch_end_publish(self) -> dict[str, Packed] | None:
        # the chief validates and saves with the latest worker's buffers
        return {"buffers": pack(self._buffers)} if self._buffers else None

    @override
    def _collect_own_metrics(self, stats: Any) -> None:
        if not self.is_server:
            super()._collect_own_metrics(stats)
            return
        coordinator = self._coordinator
        if coordinator is not None:
            self.metrics.latest(**{
                "async/workers_alive": float(len(coordinator.alive)),
                "async/workers_lost": float(coordinator.workers_lost),
                "async/workers_joined": float(coordinator.workers_joined),
                "async/batches_redrawn": float(coordinator.batches_redrawn),
            })  # fmt: skip

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.trainer
        if not self.is_server and trainer is not None:
            # a worker's loop runs until the chief ends the run: a lost worker's batches may come
            # after its last epoch, and a joined worker's loop epochs are not the run's
            trainer.fit_loop.max_epochs = -1

    @override
    def _pull_latest(self, reason: str, *, last: bool = False) -> None:
        if last:
            self._train_end()
        elif reason != "async_checkpoint" or (self.is_chief and self._fitting()):
            self._pull_members()

    def _pull_members(self) -> None:
        """The latest weights from the servers, and the buffers the latest worker published."""
        if self.async_client is None:
            return
        self.async_client.pull()
        if self._coordinator is not None:
            packed = self._coordinator.published("buffers")
        else:
            packed = fetch_published(
                "buffers", coordinator_rank=0, worker=self.global_rank, rpc_timeout=self._rpc_timeout
            )
        if packed is None or not self._buffers:
            return
        with torch.no_grad():
            for b, v in zip(self._buffers, unpack(packed, self._buffers), strict=True):
                if v is not None:
                    b.copy_(v.reshape(b.shape))

    def _train_end(self) -> None:
        """The chief ends the run and waits for the workers to take the last weights and leave; a worker takes
        them and leaves; the other servers wait for ``chief_done`` (the chief gathered the optimizer state)."""
        store = self._members.connected_store()
        coordinator = self._coordinator
        if self.is_chief and coordinator is not None:
            deadline = time.monotonic() + self.ps_timeout.total_seconds()
            coordinator.close()
            while not coordinator.left_or_lost() and time.monotonic() < deadline:
                time.sleep(0.05)
        elif self.is_server:
            store.wait(["chief_done"], self.ps_timeout)
        elif self.async_client is not None:
            self._pull_members()
            self._leave()

    def _leave(self) -> None:
        if self._members.leave(self.global_rank, self._rpc_timeout):
            self._stop_heartbeat()  # done: no beat may reach the store after the chief closes it

    @override
    def on_train_end(self) -> None:
        super().on_train_end()  # _train_end, then the chief gathers the shards' optimizer state
        if self.is_chief and self._members.store is not None:
            self._members.store.set("chief_done", "1")

    @override
    def teardown(self) -> None:
        # before the coordinator goes (the monitor uses it); no graceful RPC leave: it would ask every member, dead too
        members = self._members
        if not self.is_server and not self.failed and members.store is not None:
            with contextlib.suppress(Exception):  # a fit whose loop never ran (joined after the last batch)
                self._leave()
        members.stop_watching()
        # before its store closes: a beat after that fails in C++, which prints a stack trace at the end of a clean run
        self._stop_heartbeat()
        if self._rpc_started:
            self._rpc_started = False
            shutdown_rpc(failed=True, timeout=self.ps_timeout, grace_seconds=0.5)
        members.close()
        super().teardown()
