"""``FTStrategy`` ("ft", "local_sgd", "diloco"): data parallelism on torchft that survives lost replicas.

Every process is a torchft replica group of one process, with its own Manager and no process
group spanning the job (each process has a one-rank default group, so Lightning's collectives
are local). Replicas find each other through the Lighthouse's quorum, step by step. The hooks:

- ``_configure_launcher``: :class:`~lightning_strategies.strategies._ft_launcher.FTScriptLauncher`
  (the Lighthouse, the replicas, a supervisor that starts a lost replica again).
- ``setup_distributed`` / ``configure_ddp`` / ``distributed_sampler_kwargs``: a one-rank group, no
  DDP wrapper; training batches sharded by replica, validation and test on every replica whole.
- ``setup_environment`` / ``setup``: the :class:`FTState` callback, the Manager, the outer loop.
- ``barrier("run-stage")``: the replica joins the job: its first quorum, after Lightning restored
  any checkpoint and before the loop starts; a replica behind its peers heals here (weights,
  optimizers, LR schedulers, Lightning's loop progress, the outer loop).
- ``optimizer_step`` (``ft``): Lightning's closure, then the gradients averaged over the quorum
  and the step committed (:func:`~lightning_strategies.comm.ft.average_and_commit`).
- ``on_train_batch_start`` (``local_sgd`` / ``diloco``): the outer syncs due
  (:class:`~lightning_strategies.comm.ft.OuterSync`: blocking, or overlapped with the next inner
  steps); the last one in :class:`FTState`'s ``on_train_end``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.comm.ft import (
    CommitStats,
    OuterLoop,
    OuterSync,
    ReplicaConfig,
    ReplicaGroup,
    average_and_commit,
    check_lighthouse,
    check_sync_delay,
    lighthouse_command,
    unflatten_into,
)
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.strategies._base import MetricsWindow
from lightning_strategies.strategies._ft_launcher import (
    LIGHTHOUSE_ENV,
    RESTART_ENV,
    FTScriptLauncher,
    LighthouseSettings,
)

__all__ = ["FT_ALGORITHMS", "FTState", "FTStrategy", "ReplicaBehindError", "replica_path"]

log = logging.getLogger(__name__)

FT_ALGORITHMS = ("ft", "local_sgd", "diloco")
_WIRE_DTYPES = {None: None, "bf16": torch.bfloat16}


_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.PREDICTING, RunningStage.SANITY_CHECKING)


class ReplicaBehindError(RuntimeError):
    """A running replica found itself behind its peers (a step they committed and it did not)."""


class FTState(Callback):
    """What a recovering replica loads besides the weights and optimizers, and what a checkpoint
    keeps besides Lightning's own state.

    At the end of every training batch it keeps Lightning's loop progress and the LR schedulers'
    state: the point Lightning resumes from, as from a ``ModelCheckpoint(every_n_train_steps=1)``
    checkpoint. Its ``state_dict`` (saved in checkpoints) holds the outer loop and the Manager's step.
    """

    def __init__(self, strategy: FTStrategy) -> None:
        self.strategy = strategy
        self.kept: dict[str, Any] | None = None
        self.loaded: dict[str, Any] | None = None  # from a checkpoint, applied once the Manager exists

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.kept = progress_of(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.final_sync()

    @override
    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        outer = s.syncer.state_dict() if s.syncer is not None else None
        manager = s.replica.manager.state_dict() if s.replica is not None else None
        return {"outer": outer, "manager": manager}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def replica_path(path: Any, replica: int) -> str:
    """Where replica ``replica`` (> 0) of a ``local_sgd`` / ``diloco`` run keeps its part of checkpoint ``path``."""
    return f"{os.fspath(path)}.replica{replica}"


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The trainer's callback list (a documented attribute that Lightning sets outside ``__init__``)."""
    return trainer.callbacks  # type: ignore[attr-defined]


def progress_of(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's loop progress and LR schedulers' state (public ``state_dict`` methods)."""
    return {
        "global_step": trainer.global_step,
        "fit_loop": trainer.fit_loop.state_dict(),
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }


class FTStrategy(DDPStrategy):
    """Fault-tolerant data parallelism (``"ft"``) and LocalSGD / DiLoCo (``"local_sgd"``, ``"diloco"``) on torchft.

    ``"ft"``: every step, the replicas average their gradients over the step's quorum and commit
    (as DDP, but a lost replica leaves the quorum and the others go on; a failed all-reduce is
    tried again on a new quorum). ``"local_sgd"`` / ``"diloco"``: ``sync_every`` local optimizer
    steps, then the parameters (LocalSGD) or the pseudo-gradients with a Nesterov outer step
    (DiLoCo) are averaged, in ``fragments`` staggered groups for Streaming DiLoCo.

    Faults: a killed replica drops out of the next quorum after the Lighthouse's heartbeat timeout;
    the survivors' step in flight is tried again without it. The launcher starts it again (up to
    ``max_restarts``); it joins at its next quorum and heals from a live replica: weights,
    optimizer state, LR schedulers, Lightning's loop progress and the outer loop. The batches a
    lost replica was training are not trained by anyone (each replica keeps its own shard).

    Logged (per step, Lightning's cadence): ``ft/participants``, ``ft/manager_step``,
    ``ft/commit_attempts``, ``ft/allreduce_bytes``, ``ft/commit_s``, ``ft/heals``.

    Args:
        algorithm: ``"ft"``, ``"local_sgd"`` or ``"diloco"``.
        sync_every: H, local steps between two syncs (``local_sgd`` / ``diloco``).
        fragments: Streaming DiLoCo's parameter groups, synced in turn.
        outer_lr, outer_momentum, nesterov: DiLoCo's outer SGD (the paper's 0.7, 0.9, Nesterov).
        pseudo_grad_dtype: ``None`` or ``"bf16"``: DiLoCo's all-reduce dtype.
        fragment_sync_delay: Streaming DiLoCo's tau: a fragment's all-reduce overlaps this many inner
            steps before its outer step lands (``0 <= tau < sync_every / fragments``; 0: blocking).
        fragment_update_alpha: after an overlapped sync, the local parameters' weight against the
            new global ones (torchft's; 0: take the global ones).
        sync_buffers: average the floating buffers (BatchNorm's running statistics) at each sync of the
            last fragment; ``False``: each replica keeps its own (torchft's). Integer ones are left alone.
        lighthouse: ``"host:port"`` of a running ``torchft_lighthouse`` (multi-node); ``None``:
            the launcher (replica 0) starts one as its child process.
        min_replicas: a step commits only with at least this many replicas.
        max_restarts: restarts of each lost replica by the launcher.
        heartbeat_timeout_s, join_timeout_s: the Lighthouse the launcher starts (a survivor
            stalls about ``heartbeat_timeout_s`` after a loss).
        quorum_timeout_s: the longest wait for a quorum (must cover ``sync_every`` steps for DiLoCo).
        step_timeout_s: all-reduce, commit and checkpoint-transfer timeout.
        connect_timeout_s: reaching the Lighthouse and peers.
        commit_attempts: all-reduces tried per step before the replica gives up (and restarts).
        hostname: the address peers reach this replica at (default: ``127.0.0.1`` on one node,
            the host name on several).
        **kwargs: ``DDPStrategy``'s launch options (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``process_group_backend``, ``start_method="popen"``).

    Raises:
        ValueError: an unknown algorithm, ``sync_every < 1``, ``outer_lr <= 0``, ``sync_every`` not
            a multiple of ``fragments``, ``pseudo_grad_dtype`` other than bf16, negative restarts or
            ``commit_attempts < 1``, a start method other than ``popen``; at setup a model without
            parameters, more fragments than parameter tensors, or several optimizers.
        LighthouseUnreachableError: at setup, no Lighthouse at the address.
    """

    strategy_name = "ft"

    def __init__(
        self,
        *,
        algorithm: str = "ft",
        sync_every: int = 100,
        fragments: int = 1,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        pseudo_grad_dtype: str | None = None,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        sync_buffers: bool = True,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        max_restarts: int = 3,
        heartbeat_timeout_s: float = 5.0,
        join_timeout_s: float = 1.0,
        quorum_timeout_s: float = 60.0,
        step_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        commit_attempts: int = 3,
        hostname: str | None = None,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        if algorithm not in FT_ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: expected one of {FT_ALGORITHMS}. Fix: pick one of them.")
        if pseudo_grad_dtype not in _WIRE_DTYPES or (pseudo_grad_dtype and algorithm != "diloco"):
            raise ValueError(
                f"pseudo_grad_dtype={pseudo_grad_dtype!r} with algorithm={algorithm!r}: expected None, or 'bf16' with "
                "algorithm='diloco' (the pseudo-gradients' all-reduce). Fix: drop it or use strategy='diloco'."
            )
        self.sync_every, self.fragments = sync_every, fragments
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.fragment_sync_delay, self.fragment_update_alpha = fragment_sync_delay, fragment_update_alpha
        self.sync_buffers = sync_buffers
        if algorithm != "ft":  # the outer loop's own checks, now rather than at setup
            OuterLoop([torch.nn.Parameter(torch.zeros(1)) for _ in range(max(1, fragments))],
                      algorithm=algorithm, **{**self._outer_options(), "fragments": max(1, fragments)})  # fmt: skip
        else:  # no outer loop: no overlap either
            check_sync_delay(fragment_sync_delay, fragment_update_alpha, algorithm=algorithm, sync_every=1, fragments=1)
        if max_restarts < 0 or commit_attempts < 1:
            raise ValueError(
                f"max_restarts={max_restarts}, commit_attempts={commit_attempts}: expected max_restarts >= 0 and "
                "commit_attempts >= 1. Fix: pass e.g. max_restarts=3, commit_attempts=3."
            )
        if start_method != "popen":
            raise ValueError(
                f"FTStrategy(start_method={start_method!r}): Lightning's {start_method!r} launcher ends every process "
                "when one dies, which this strategy is there to survive. Expected 'popen' (or processes started by "
                "torchrun, SLURM, by hand). Fix: pass start_method='popen' (the default)."
            )
        super().__init__(start_method="popen", **kwargs)
        self.algorithm = algorithm
        self.pseudo_grad_dtype = pseudo_grad_dtype
        self.lighthouse = lighthouse
        self.max_restarts, self.commit_attempts = max_restarts, commit_attempts
        self.heartbeat_timeout_s, self.join_timeout_s = heartbeat_timeout_s, join_timeout_s
        self.hostname = hostname
        self.replica_config = ReplicaConfig(
            min_replicas=min_replicas,
            timeout_s=step_timeout_s,
            quorum_timeout_s=quorum_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        self.replica: ReplicaGroup | None = None
        self.outer: OuterLoop | None = None
        self.syncer: OuterSync | None = None  # runs the outer loop's syncs (local_sgd / diloco)
        self.state_callback: FTState | None = None
        self.metrics = MetricsWindow()
        #: this replica's all-reduces since the fit began: payload bytes (sent = received), calls, seconds
        self.comm_stats = CommStats()
        self._joined = False  # this fit's first quorum is done
        self._quorum_open = False  # a quorum started and not yet used by a commit
        self._own_group = False

    def _outer_options(self) -> dict[str, Any]:
        """The outer loop's options, as this strategy was given them."""
        return {
            "sync_every": self.sync_every, "fragments": self.fragments, "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "nesterov": self.nesterov,
            "fragment_sync_delay": self.fragment_sync_delay, "fragment_update_alpha": self.fragment_update_alpha,
        }  # fmt: skip

    # -- processes: the launcher, a one-rank group, no DDP wrapper --------------------------------

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        assert env is not None
        settings = None
        if self.lighthouse is None:
            settings = LighthouseSettings(
                min_replicas=self.replica_config.min_replicas,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                join_timeout_s=self.join_timeout_s,
                host=self._host(),
            )
        self._launcher = FTScriptLauncher(
            env, self.num_processes, self.num_nodes, lighthouse=settings, max_restarts=self.max_restarts,
            finish_timeout_s=self.replica_config.quorum_timeout_s + self.replica_config.timeout_s,
        )  # fmt: skip

    def _host(self) -> str:
        if self.hostname is not None:
            return self.hostname
        return "127.0.0.1" if self.num_nodes == 1 else socket.gethostname()

    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        # one rank per process: Lightning's collectives (logging's sync_dist, barriers, broadcasts)
        # stay local, and nothing pairs this process with a peer that may be gone
        if not dist.is_initialized():
            dist.init_process_group(
                self._get_process_group_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=self._timeout
            )
            self._own_group = True

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: gradients are averaged in :meth:`optimizer_step`."""

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.stage in _EVAL_STAGES:
            return {"num_replicas": 1, "rank": 0}  # validation and test: every replica on the whole set
        # training, and before the fit (an app sizing its batches and scaling plan by the replicas)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # -- setup: the state callback, the Manager, the outer loop ----------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            # before Lightning restores a checkpoint's callbacks, so that its state reaches this one;
            # first, so that the others' on_train_end see the last sync's weights
            self.state_callback = FTState(self)
            _callbacks(module.trainer).insert(0, self.state_callback)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                f"FTStrategy(algorithm={self.algorithm!r}) found a model without parameters ({type(module).__name__}): "
                "expected at least one with requires_grad=True, since replicas average gradients or parameters. "
                "Fix: give the LightningModule trainable parameters."
            )
        if len(self.optimizers) != 1:
            raise ValueError(
                f"FTStrategy found {len(self.optimizers)} optimizers: expected exactly 1, since every optimizer step "
                "is one committed step of the replicas. Fix: return one optimizer from configure_optimizers."
            )
        if self.algorithm != "ft":
            self.outer = _outer_loop(self, module, params)
            self.syncer = OuterSync(self.outer, attempts=self.commit_attempts, requorum=self._requorum)
        self.replica = _start_replica(self)
        loaded = self.state_callback.loaded if self.state_callback is not None else None
        if loaded is not None:  # a checkpoint's outer loop and Manager step
            if self.syncer is not None and loaded.get("outer") is not None:
                self.syncer.load_state_dict(loaded["outer"])
            if loaded.get("manager") is not None:
                self.replica.manager.load_state_dict(loaded["manager"])
        self._joined, self._quorum_open = False, False
        self.comm_stats = CommStats()

    def _load_optimizers(self, states: list[dict[str, Any]]) -> None:
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)

    def _progress(self) -> dict[str, Any]:
        kept = self.state_callback.kept if self.state_callback is not None else None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        assert trainer is not None
        return kept if kept is not None else progress_of(trainer)

    def _load_progress(self, state: dict[str, Any]) -> None:
        if self._joined:
            # Lightning's loop cannot jump mid-run: the replica restarts and heals when it joins
            raise ReplicaBehindError(
                f"replica {self.global_rank} found itself behind its peers mid-run (Manager step "
                f"{state['global_step']} served, a step they committed and it did not): expected to be behind only "
                "when joining. It ends now, so that the launcher starts it again and it heals from a peer as it joins."
            )
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        assert trainer is not None
        if state["global_step"] == 0:
            return  # every replica's loop is at its start (step 0: init_sync heals weights only)
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        for config, sd in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(sd)

    # -- joining: the first quorum, after any checkpoint restore, before the loop ----------------

    @override
    def barrier(self, name: str | None = None) -> None:
        # "run-stage" is Lightning's barrier between restoring a checkpoint and running the loop:
        # the replica joins there, so what it heals is not overwritten by the restore and reaches the loop
        if name == "run-stage" and not self._joined and self.replica is not None and self._fitting():
            self._join()
        super().barrier(name)

    def _fitting(self) -> bool:
        return self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING

    def _join(self) -> None:
        replica, trainer = self.replica, self.lightning_module.trainer if self.lightning_module else None
        assert replica is not None and trainer is not None
        healed = _first_quorum(self, replica)
        self._joined, self._quorum_open = True, True
        log.info(f"ft: replica {self.global_rank} joined at step {trainer.global_step} (healed: {healed})")
        if self.syncer is not None:
            # the peers' sync (a start, or a blocking retry) on this quorum; a checkpoint's in-flight one again
            stats = self.syncer.advance(replica.manager, trainer.global_step, quorum_open=True)
            if stats is not None:
                self._record(stats, log=False)
            elif replica.step == 0 and self.syncer.pending is None:
                # commit the join (at step 0 every quorum would heal all replicas but one, init_sync),
                # through a one-value all-reduce: a barrier behind the heals, which a commit would block
                average_and_commit(replica.manager, lambda: [torch.zeros(1)], attempts=1, requorum=self._requorum)
            self._quorum_open = False

    def _requorum(self) -> bool:
        assert self.replica is not None
        return self.replica.start_quorum()  # a mid-run heal raises ReplicaBehindError from _load_progress

    # -- steps -------------------------------------------------------------------------------------

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if self.algorithm != "ft" or self.replica is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # a local (inner) step

        def averaged_closure() -> Any:
            loss = closure()
            self._average_gradients(optimizer)
            return loss

        return super().optimizer_step(optimizer, averaged_closure, model, **kwargs)

    def _average_gradients(self, optimizer: Optimizer) -> None:
        replica = self.replica
        assert replica is not None
        if not self._quorum_open:
            self._requorum()
        self._quorum_open = False
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

        def grads() -> list[torch.Tensor]:
            return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

        flat, stats = average_and_commit(replica.manager, grads, attempts=self.commit_attempts, requorum=self._requorum)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            unflatten_into(flat, [p.grad for p in params if p.grad is not None])
        self._record(stats)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._sync_if_due()

    def final_sync(self) -> None:
        """The syncs due after the last inner step (``local_sgd`` / ``diloco``), an overlapped one in
        flight included: run by :class:`FTState` first among the callbacks' ``on_train_end``, so that
        they see its weights."""
        self._sync_if_due(log=False, end=True)

    def _sync_if_due(self, *, log: bool = True, end: bool = False) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if self.syncer is None or self.replica is None or trainer is None:
            return
        stats = self.syncer.advance(self.replica.manager, trainer.global_step, end=end)
        if stats is not None:
            self._record(stats, log=log)

    def _record(self, stats: CommitStats, *, log: bool = True) -> None:
        replica = self.replica
        assert replica is not None
        self.comm_stats += CommStats(
            bytes_sent=stats.bytes, bytes_received=stats.bytes, calls=stats.attempts, seconds=stats.seconds
        )
        self.metrics.add(**{
            "ft/participants": float(stats.participants),
            "ft/commit_attempts": float(stats.attempts),
            "ft/allreduce_bytes": float(stats.bytes),
            "ft/commit_s": stats.seconds,
        })  # fmt: skip
        self.metrics.latest(**{"ft/manager_step": float(replica.step), "ft/heals": float(replica.heals)})
        if log:  # not where Lightning forbids self.log (joining, on_train_end)
            self.metrics.flush_if_due(self.lightning_module)

    # -- checkpoints: one file per replica under local_sgd / diloco -------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Replica 0 writes ``filepath``; under ``local_sgd`` / ``diloco`` every other replica also
        writes its own ``<filepath>.replica<r>``, since its weights and inner optimizer differ
        between syncs (under ``ft`` they are replica 0's)."""
        if self.algorithm != "ft" and not self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, replica_path(filepath, self.global_rank), storage_options)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        own = replica_path(checkpoint_path, self.global_rank)
        path = own if self.algorithm != "ft" and self.global_rank > 0 and os.path.exists(own) else checkpoint_path
        return super().load_checkpoint(path, weights_only)

    # -- the end ---------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None
        module = self.lightning_module
        if self.state_callback is not None and module is not None and module._trainer is not None:
            callbacks = _callbacks(module.trainer)
            if self.state_callback in callbacks:
                callbacks.remove(self.state_callback)
        self.state_callback = None
        self.metrics.clear()
        super().teardown()
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False


def _outer_loop(self: FTStrategy, module: Module, params: list[torch.nn.Parameter]) -> OuterLoop:
    """The outer loop of ``local_sgd`` / ``diloco`` over ``params`` (and ``module``'s buffers with ``sync_buffers``)."""
    buffers = list(module.buffers()) if self.sync_buffers else []
    return OuterLoop(params, algorithm=self.algorithm, pseudo_grad_dtype=_WIRE_DTYPES[self.pseudo_grad_dtype],
                     buffers=buffers, **self._outer_options())  # fmt: skip


def _start_replica(self: FTStrategy) -> ReplicaGroup:
    """The Lighthouse checked, this replica's Manager built and its state registered."""
    address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise RuntimeError(
            f"FTStrategy (replica {self.global_rank}) found no Lighthouse address: expected lighthouse='host:port' "
            f"or {LIGHTHOUSE_ENV} set (the launcher sets it when it starts one). Fix: start one with "
            f"`{lighthouse_command(self.replica_config.min_replicas, self.heartbeat_timeout_s)}` and pass "
            "lighthouse='<its host>:29510', or launch with start_method='popen' from one process."
        )
    url = check_lighthouse(
        address,
        timeout_s=self.replica_config.connect_timeout_s,
        min_replicas=self.replica_config.min_replicas,
        heartbeat_timeout_s=self.heartbeat_timeout_s,
    )
    replica = ReplicaGroup(
        self.replica_config, lighthouse=url, replica_id=f"replica_{self.global_rank}",
        device=self.root_device, hostname=self._host(),
    )  # fmt: skip
    module = self.lightning_module
    assert module is not None
    replica.register("model", module.load_state_dict, module.state_dict)
    replica.register("optimizers", self._load_optimizers, lambda: [o.state_dict() for o in self.optimizers])
    replica.register("progress", self._load_progress, self._progress)
    if self.syncer is not None:
        replica.register("outer", self.syncer.load_state_dict, self.syncer.state_dict)
    return replica


def _first_quorum(self: FTStrategy, replica: ReplicaGroup) -> bool:
    """This fit's first quorum (at step 0, init_sync: every replica but one heals from it); returns
    whether this replica healed."""
    healed = replica.start_quorum()  # step 0 (init_sync): every replica but one heals from it
    world = self.num_nodes * self.num_processes
    restart = int(os.environ.get(RESTART_ENV, "0")) > 0
    if not restart:
        # a job starts with every replica (as DDP would), or after quorum_timeout_s with those there
        deadline = time.monotonic() + self.replica_config.quorum_timeout_s
        while replica.participants() < world and time.monotonic() < deadline:
            time.sleep(0.2)
            healed |= replica.start_quorum()
    elif world > 1 and replica.participants() < 2:
        raise RuntimeError(
            f"replica {self.global_rank}, started again, found no live replica to heal from (a quorum of 1): "
            "expected one of its peers still training. The job has ended or lost every other replica; this "
            "replica ends rather than train from its own start."
        )
    return healed
