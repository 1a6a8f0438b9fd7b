"""``ParameterServerStrategy`` ("parameter_server", "ps"): synchronous sharded parameter servers.

The strategy is DDP without the ``DistributedDataParallel`` wrapper: the same launchers, the
same gloo/NCCL process group (Lightning's ``barrier``, ``broadcast``, ``reduce`` and
``sync_dist`` logging keep using it), but gradients are not all-reduced. Instead every rank
also runs a TensorPipe RPC agent and hosts one shard of the parameter server
(:mod:`lightning_strategies.comm.ps`); the optimizer runs on the shards, and the worker's
optimizer step becomes "push gradients, pull new values". The hooks changed are:

- ``setup_environment``: start RPC after the process group (its own rendezvous port).
- ``setup``: no DDP wrapper; broadcast rank 0's weights, build the shards and the client.
- ``training_step``: broadcast rank 0's buffers first, as DDP does (BatchNorm statistics).
- ``optimizer_step``: run Lightning's closure, then push/pull instead of a local step.
- ``optimizer_state`` / ``load_optimizer_state_dict``: gather / scatter the shards' state.
- ``teardown``: shut RPC down (gracefully unless the run failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import ATOMIC_CHECKPOINT_IO_DEFAULT
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    shard_loads,
    shard_parameters,
)
from lightning_strategies.comm.rpc import (
    free_port,
    init_rpc,
    local_shard,
    register_shard,
    shutdown_rpc,
    unregister_shard,
    worker_name,
)
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.faults import PeerFailureMixin
from lightning_strategies.strategies._elastic import ElasticRestartMixin

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger(__name__)


class ParameterServerStrategy(PeerFailureMixin, ElasticRestartMixin, DDPStrategy):
    """Synchronous data parallelism through sharded, co-located parameter servers.

    Each step every worker pushes its gradients to the shards (all in parallel), each shard
    waits for all workers, averages, runs the user's optimizer on its slice and answers with
    the new values: the same arithmetic as DDP, with the optimizer on the servers. The learning
    rate of the worker's optimizer travels with each push, so LR schedulers and warmup work.

    Logged at Lightning's step-logging cadence (``Trainer(log_every_n_steps=...)``), as per-step
    means over the steps since the last log: ``comm/bytes_sent`` and ``comm/bytes_received``
    (this worker's gradients pushed and values pulled), ``ps/server_bytes_max`` (the busiest
    shard's received + sent bytes in one step; the maximum) and ``ps/wait_seconds`` (from the
    first push to the last answer).

    Not supported (each raises at setup, saying what to change): manual optimization and more
    than one optimizer (the servers run one optimizer inside Lightning's step), gradient
    clipping (DDP clips the averaged gradient, which no single shard holds whole), and an
    optimizer-side global norm (``Lamb(max_grad_norm=...)``) over more than one shard.

    On a fault: when a rank dies, the RPCs to its shard fail at once (its connections close),
    and a shard waiting for its push fails after ``timeout``; a hung rank fails the others after
    ``timeout``. The survivors' errors name the lost rank(s) from their heartbeats
    (``"parameter_server: lost peer rank 1 of 4: ..."``, :mod:`lightning_strategies.faults`; a
    :class:`~lightning_strategies.PeerLostError` when a step failed, else a note on the error),
    and RPC shuts down without waiting for the dead.

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        num_servers: number of shards, hosted by ranks ``0 .. num_servers-1``; default the
            world size (every rank serves ``1/P`` of the parameters, the balanced layout).
        timeout: how long the process group's collectives and a shard's barrier wait for a
            slow or hung peer before failing (the error names the missing worker); RPCs wait
            a little longer (``timeout`` + max(5 s, 10%)), so the shard's error arrives first.
            Default 30 minutes, as DDP.
        rpc_threads: RPC server threads per process. Handlers never block, so a few suffice;
            each extra thread competes with training for the cores.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device, as for DDP.
        start_method: how ranks start, as for ``DDPStrategy``: ``"popen"`` (re-runs the script;
            torchrun, SLURM), ``"spawn"``, ``"fork"`` (fast on CPU) or ``"forkserver"``.
    """

    strategy_name = "parameter_server"
    checkpoint_io = ATOMIC_CHECKPOINT_IO_DEFAULT  # atomic checkpoint writes unless the user gives an IO

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        num_servers: int | None = None,
        timeout: timedelta | None = default_pg_timeout,
        rpc_threads: int = 4,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if num_servers is not None and num_servers < 1:
            raise ValueError(
                f"ParameterServerStrategy(num_servers={num_servers}): expected at least 1 server shard. "
                "Fix: pass num_servers between 1 and the number of processes, or None for one per process."
            )
        if rpc_threads < 1:
            raise ValueError(
                f"ParameterServerStrategy(rpc_threads={rpc_threads}): expected at least 1 RPC thread. "
                "Fix: pass a small positive count (the default 4 suits a few cores)."
            )
        self._num_servers = num_servers
        self._rpc_threads = rpc_threads
        self._rpc_started = False
        self._failed = False
        self._client: ParameterServerClient | None = None
        self._spec: OptimizerSpec | None = None
        self._server_step: _ServerStepOptimizer | None = None
        self._buffers: list[Tensor] = []
        self._state_at_fit_end: dict[str, Any] | None = None  # for Trainer.save_checkpoint after fit
        # communication since the last logged step
        self._window = CommStats()
        self._window_steps = 0
        self._window_server_max = 0

    @property
    def num_servers(self) -> int:
        """Shard count in effect: the ``num_servers`` option, or the world size."""
        return self._num_servers if self._num_servers is not None else self.world_size

    @property
    def ps_timeout(self) -> timedelta:
        return self._timeout if self._timeout is not None else default_pg_timeout

    @property
    def client(self) -> ParameterServerClient | None:
        """This worker's push/pull handle (``None`` outside of fitting)."""
        return self._client

    # -- environment ---------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group: Lightning's collectives keep using it
        if self.num_servers > self.world_size:
            raise ValueError(
                f"ParameterServerStrategy(num_servers={self.num_servers}) with {self.world_size} processes: "
                f"expected 1 <= num_servers <= {self.world_size}, since rank r hosts shard r. Fix: pass "
                f"num_servers <= {self.world_size}, or start more processes (devices x num_nodes)."
            )
        self._start_rpc()

    def _start_rpc(self) -> None:
        """Start the RPC agent with a rendezvous port of its own, picked by rank 0.

        ``MASTER_PORT`` already carries the process group's store, so rank 0 finds a free port
        on its host and broadcasts it over the process group; every rank then meets there.
        """
        assert self.cluster_environment is not None
        port = [free_port("") if self.global_rank == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        init_method = f"tcp://{self.cluster_environment.main_address}:{port[0]}"
        device_maps = None
        if self.root_device.type == "cuda":
            # TensorPipe moves CUDA tensors directly once told which device each peer uses
            devices: list[Any] = [None] * self.world_size
            dist.all_gather_object(devices, self.root_device)
            device_maps = {
                worker_name(r): {self.root_device: d} for r, d in enumerate(devices) if r != self.global_rank
            }
        init_rpc(
            self.global_rank,
            self.world_size,
            init_method,
            timeout=self.ps_timeout,
            num_threads=self._rpc_threads,
            device_maps=device_maps,
        )
        self._rpc_started = True

    # -- model and optimizer -------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_supported(trainer)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # rank 0's initial weights everywhere, as DDP's constructor does (and after a restore)
        _sync_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self._start_servers()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        return model  # no DDP wrapper: gradients are averaged on the servers

    def _check_supported(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ValueError(
                "ParameterServerStrategy found `automatic_optimization = False`: expected automatic "
                "optimization, because the optimizer step runs on the servers inside Lightning's "
                "optimizer_step. Fix: use automatic optimization, or strategy='ddp' for manual optimization."
            )
        if trainer.gradient_clip_val:
            raise ValueError(
                f"ParameterServerStrategy found Trainer(gradient_clip_val={trainer.gradient_clip_val}): "
                "gradient clipping is unsupported, because DDP clips the *averaged* gradient and under a "
                "parameter server only the shards see it (each one a slice). Expected "
                "gradient_clip_val=None. Fix: drop gradient clipping (LAMB's trust ratio bounds each "
                "layer's step), or use strategy='ddp'."
            )

    def _plan_servers(self) -> tuple[Optimizer, OptimizerSpec, list[Tensor], list[int], list[list[int]]]:
        """Check the optimizer can run on the shards.

        Returns:
            The optimizer, its rebuild spec, its parameters, their sizes and the shard plan.
        """
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} found {len(self.optimizers)} optimizers from configure_optimizers: "
                "expected exactly one, because the servers run one optimizer over the whole model. Fix: "
                "return one optimizer (use param groups for different hyperparameters)."
            )
        optimizer = self.optimizers[0]
        self._spec = OptimizerSpec.from_optimizer(optimizer)
        if self._spec.defaults.get("max_grad_norm") is not None and self.num_servers > 1:
            # LAMB (timm-style) clips by the norm over *all* its tensors; each shard sees a slice
            raise ValueError(
                f"{type(self).__name__} found {type(optimizer).__qualname__}(max_grad_norm="
                f"{self._spec.defaults['max_grad_norm']}) with num_servers={self.num_servers}: the global "
                "gradient norm spans every shard, but each shard's optimizer sees only its slice. Expected "
                "max_grad_norm=None, or num_servers=1. Fix: drop max_grad_norm, or pass num_servers=1."
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = [p.numel() for p in params]
        return optimizer, self._spec, params, sizes, shard_parameters(sizes, self.num_servers)

    def _start_servers(self) -> None:
        """Build this rank's shard and its client; a barrier makes every shard reachable first."""
        optimizer, spec, params, sizes, plan = self._plan_servers()
        rank = self.global_rank
        if rank < self.num_servers:
            shard = ParameterShard(
                rank,
                plan[rank],
                [params[i] for i in plan[rank]],
                spec,
                self.world_size,
                timeout=self.ps_timeout,
            )
            register_shard(shard)
        log.debug(f"{type(self).__name__}: shard loads (elements) {shard_loads(sizes, plan)}")
        # no push may reach a rank before its shard is registered
        self.barrier("ps_shards_ready")
        self._client = ParameterServerClient(rank, params, plan, timeout=self.ps_timeout)
        self._server_step = _ServerStepOptimizer(optimizer, self._push_pull)
        assert self.model is not None
        self._buffers = [b for b in self.model.buffers() if self.world_size > 1]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run Lightning's closure (forward, backward, hooks), then push/pull instead of stepping.

        The precision plugin receives a stand-in whose ``step`` is the push/pull, so every
        precision plugin's closure handling and ``on_before_optimizer_step`` hooks still run.
        """
        if self._server_step is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        with self._peer_watch():  # a lost peer raises PeerLostError (super() is not called here)
            return self.precision_plugin.optimizer_step(self._server_step, model=model, closure=closure, **kwargs)

    def _push_pull(self, optimizer: Optimizer) -> None:
        assert self._client is not None
        lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._client.push_pull(lrs)
        self._window += self._client.stats.reset()
        self._window_steps += 1
        self._window_server_max = max(self._window_server_max, max(self._client.last_server_bytes, default=0))
        module = self.lightning_module
        if module is None or module._current_fx_name is None or not _should_update_logs(module):
            return
        # per-step means over the steps since the last log (the busiest shard: the maximum);
        # logging only when Lightning writes step metrics, as each `log` call costs ~0.3 ms
        n = self._window_steps
        window = self._window.reset()
        metrics = {
            "comm/bytes_sent": window.bytes_sent / n,
            "comm/bytes_received": window.bytes_received / n,
            "ps/server_bytes_max": float(self._window_server_max),
            "ps/wait_seconds": window.seconds / n,
        }
        self._window_steps, self._window_server_max = 0, 0
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Broadcast rank 0's buffers (BatchNorm statistics) before the forward, then step.

        DDP does the same before every forward (``broadcast_buffers=True``), so models with
        buffers keep matching it; models without buffers pay nothing.
        """
        if self._buffers:
            _broadcast_from_rank0(self._buffers)
        return super().training_step(*args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------------

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The servers' optimizer state, gathered on rank 0 in the worker optimizer's format.

        Rank 0 asks every shard over RPC (the other ranks' training threads need not take
        part), so the file loads into a single-device optimizer of the same model too.
        Each group's ``lr`` is the worker's: a shard holds the lr of the last push, while the
        worker's group already holds the one its LR scheduler set for the next step, which a
        resumed run must start with (as a DDP checkpoint does).
        """
        if self._client is None or self._spec is None:
            if self._state_at_fit_end is not None:
                return self._state_at_fit_end  # after fit: the servers are gone
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if not self.is_global_zero:
            return {}
        state = self._client.gather_state_dict(self._spec, optimizer.param_groups)
        for group, worker_group in zip(state["param_groups"], optimizer.param_groups, strict=True):
            group["lr"] = worker_group["lr"]
        return state

    @override
    def on_train_end(self) -> None:
        # The shards and their optimizer state go with RPC at teardown, and the worker optimizer
        # never steps (its state is empty): without this, a Trainer.save_checkpoint after fit
        # would silently save no momentum / Adam moments.
        if self._client is not None and self.optimizers:
            self._state_at_fit_end = self.optimizer_state(self.optimizers[0])
            self.barrier("ps_state_at_fit_end")  # no shard leaves (teardown) before rank 0 has read it
        super().on_train_end()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Restore each shard's part of the gathered state, and the worker's group options.

        The worker's optimizer never steps, but its param groups hold the learning rate the LR
        schedulers read and write, so they are restored too. No collective is needed: a shard
        steps only once its own host's worker has pushed, which happens after this returns.
        """
        if self._client is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        states = checkpoint["optimizer_states"]
        if len(states) != 1 or "param_groups" not in states[0]:
            raise ValueError(
                f"ParameterServerStrategy found {len(states)} optimizer states in the checkpoint (keys "
                f"{[sorted(s) for s in states]}): expected one full optimizer state dict. Fix: resume from a "
                "checkpoint written by a one-optimizer run (this strategy or a single device)."
            )
        full = states[0]
        optimizer = self.optimizers[0]
        optimizer.load_state_dict({"state": {}, "param_groups": full["param_groups"]})
        shard = local_shard(self.global_rank)
        if shard is not None:
            shard.load_state_dict(full)

    # -- shutdown ------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # peers may be gone: a graceful RPC shutdown would wait for them
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Drop the shard and stop RPC.

        A graceful shutdown waits (bounded by ``timeout``) until every rank has finished its
        RPCs, so no rank closes while a peer still needs its shard; after a failure the
        shutdown is local, since the peers may be dead.
        """
        if self._client is not None:
            self._client = None
            self._server_step = None
            self._buffers = []
            unregister_shard(self.global_rank)
        if self._rpc_started:
            self._rpc_started = False
            try:
                shutdown_rpc(failed=self._failed, timeout=self.ps_timeout)
            except Exception as err:
                log.warning(f"{type(self).__name__}: RPC shutdown failed: {err}")
                shutdown_rpc(failed=True, timeout=self.ps_timeout, grace_seconds=0.0)
        super().teardown()


def _should_update_logs(module: pl.LightningModule) -> bool:
    """Whether Lightning writes step metrics at this step (``Trainer(log_every_n_steps=...)``)."""
    trainer = module._trainer
    if trainer is None:
        return False
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except (AttributeError, NotImplementedError):  # another Lightning version: log every step
        return True


def _broadcast_from_rank0(tensors: list[Tensor]) -> None:
    """Rank 0's values of ``tensors`` everywhere, one broadcast per dtype (flattened)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                t.copy_(synced)


class _ServerStepOptimizer(Optimizer):
    """The worker optimizer as the precision plugin sees it, with ``step`` = push/pull.

    It shares the worker optimizer's param groups (the very dicts LR schedulers write) and its
    (empty) state, so hooks and gradient scalers see the real parameters, while the update
    itself happens on the servers.
    """

    def __init__(self, worker: Optimizer, push_pull: Callable[[Optimizer], None]) -> None:
        super().__init__(worker.param_groups, worker.defaults)
        self.param_groups = worker.param_groups
        self.state = worker.state
        self.worker = worker
        self._push_pull = push_pull

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_pull(self.worker)
        # tell torch's LR schedulers that this optimizer did step (on the servers)
        self.worker._opt_called = True  # type: ignore[attr-defined]
        return loss
