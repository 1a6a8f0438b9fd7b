"""``ParameterServerStrategy`` ("parameter_server", "ps"): synchronous sharded parameter servers.

The strategy is DDP without the ``DistributedDataParallel`` wrapper: the same launchers, the
same gloo/NCCL process group (Lightning's ``barrier``, ``broadcast``, ``reduce`` and
``sync_dist`` logging keep using it), but gradients are not all-reduced. Instead every rank
also runs a TensorPipe RPC agent and hosts one shard of the parameter server
(:mod:`lightning_strategies.comm.ps`); the optimizer runs on the shards, and the worker's
optimizer step becomes "push gradients, pull new values". The hooks changed are:

- ``setup_environment``: start RPC after the process group (its own rendezvous port).
- ``configure_ddp``: no DDP wrapper; check what the servers support, broadcast rank 0's weights.
- ``setup_optimizers``: then build this rank's shard and its client (``_make_shard``,
  ``_make_client``: what ``"async"`` overrides).
- ``training_step``: broadcast rank 0's buffers first, as DDP does (BatchNorm statistics).
- ``optimizer_step``: the optimizer's step runs Lightning's closure, then push/pull instead of a
  local update (a step pre-hook); its metrics are collected after the step (``_after_optimizer_step``).
- ``optimizer_state`` / ``load_optimizer_state_dict``: gather / scatter the shards' state;
  ``on_train_end`` keeps the gathered state for a ``Trainer.save_checkpoint`` after fit.
- ``teardown``: shut RPC down (gracefully unless the run failed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_strategies.comm.amp import AgreedGradScaler
from lightning_strategies.comm.heartbeat import failure_reason
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    Slice,
    broadcast_from_rank0,
    local_shard,
    partition_loads,
    partition_parameters,
    register_shard,
    shard_parameters,
    slice_of,
    unregister_shard,
    whole_tensor_slices,
)
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc, worker_name
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.strategies._base import StrategyBase, unwrap_optimizer

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger(__name__)


class ParameterServerStrategy(StrategyBase):
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

    Under ``16-mixed`` the gradient scaler's skip decision is shared over the ranks
    (:class:`~lightning_strategies.comm.amp.AgreedGradScaler` replaces Lightning's, same options and
    state), so an overflow on any rank skips the step everywhere, as under DDP; ``amp/step_skipped``
    is logged. On CUDA the shards order their device work on streams of their own.

    Not supported (each raises at setup, saying what to change): manual optimization and more
    than one optimizer (the servers run one optimizer inside Lightning's step), gradient
    clipping (DDP clips the averaged gradient, which no single shard holds whole), and an
    optimizer-side global norm (``Lamb(max_grad_norm=...)``) over more than one shard.

    On a fault: the RPCs to a dead rank's shard fail at once, a shard waiting for a push fails
    after ``timeout``; the survivors' errors name the lost rank(s) (``"parameter_server: lost peer
    rank 1 of 4: ..."``, a :class:`~lightning_strategies.PeerLostError` when a step failed), and
    RPC shuts down without waiting for the dead.

    Args:
        num_servers: number of shards, hosted by ranks ``0 .. num_servers-1``; default the
            world size (every rank serves ``1/P`` of the parameters, the balanced layout).
        rpc_threads: RPC server threads per process. Handlers never block, so a few suffice;
            each extra thread competes with training for the cores.
        **kwargs: ``timeout`` (how long the process group's collectives and a shard's barrier
            wait for a slow or hung peer before failing, the error naming the missing worker;
            RPCs wait a little longer, ``timeout`` + max(5 s, 10%), so the shard's error arrives
            first; default 30 minutes, as DDP), ``process_group_backend`` (``"gloo"`` /
            ``"nccl"``; default by device) and ``start_method`` (``"popen"`` re-runs the script,
            for torchrun and SLURM; ``"spawn"``, ``"fork"`` (fast on CPU) or ``"forkserver"``),
            as for ``DDPStrategy``, and the plugins the Trainer sets.

    Raises:
        ValueError: for a non-positive ``num_servers`` or ``rpc_threads``; at setup, for what
            is not supported (above) or more servers than processes.
        TypeError: for DDP-wrapper options (``find_unused_parameters``, ...): there is no wrapper.
    """

    strategy_name = "parameter_server"
    # DDP's broadcast of rank 0's buffers before every forward; it pairs the ranks' steps, so a
    # strategy whose ranks take different numbers of steps turns it off
    broadcast_buffers_each_step: ClassVar[bool] = True
    # Under 16-mixed every rank skips an overflowing step together (the found-inf flag is summed
    # over the ranks before the scaler decides): a rank that skipped alone would never push, and
    # the barrier would wait for it. Async, with no barrier, lets each rank skip alone.
    agree_on_overflow: ClassVar[bool] = True

    wraps_ddp = False

    def __init__(self, *, num_servers: int | None = None, rpc_threads: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
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
        self._client: ParameterServerClient | None = None
        self._spec: OptimizerSpec | None = None
        self._step_hook: RemovableHandle | None = None
        self._buffers: list[Tensor] = []  # rank 0's are broadcast (each step, or at sync points)

    @property
    def num_servers(self) -> int:
        """Shard count in effect: the ``num_servers`` option, or the world size."""
        return self._num_servers if self._num_servers is not None else self.world_size

    @property
    def ps_timeout(self) -> timedelta:
        """The timeout of the shards' barrier (and the base of the RPC timeout)."""
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
        """Start the RPC agent, meeting in a store of its own that rank 0 serves on a port of the
        kernel's choice (``MASTER_PORT`` carries the process group's store)."""
        assert self.cluster_environment is not None
        store = rendezvous_store(
            self.global_rank, self.world_size, self.cluster_environment.main_address, timeout=self.ps_timeout
        )
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
            store,
            timeout=self.ps_timeout,
            num_threads=self._rpc_threads,
            device_maps=device_maps,
        )
        self._rpc_started = True

    # -- model and optimizer -------------------------------------------------------------------

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel`` wrapper (gradients are averaged on the servers): check
        what the servers support, then rank 0's weights everywhere, as DDP's constructor does."""
        trainer = self.trainer
        assert trainer is not None and self.model is not None
        self._check_supported(trainer)
        _sync_module_states(self.model)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The optimizers, then (when fitting) this rank's shard and its client."""
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_servers()

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

    def _plan_servers(self) -> tuple[Optimizer, OptimizerSpec, list[Tensor], list[list[Slice]]]:
        """Check the optimizer can run on the shards, and partition its parameters.

        An elementwise optimizer (SGD, Adam, AdamW, ...: ``OptimizerSpec.elementwise``) gets the
        flattened parameters cut into equal ranges (:func:`partition_parameters`; a tensor may
        span servers). A layer-wise one (LAMB, LARS: a trust ratio from a whole tensor's norms)
        keeps whole tensors per server (:func:`shard_parameters`), less balanced when a few
        tensors dominate the model; a rank-zero info line says so.

        Returns:
            The optimizer, its rebuild spec, its parameters and the shard plan.
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
        if self._spec.elementwise:
            plan = partition_parameters(sizes, self.num_servers)
        else:
            plan = whole_tensor_slices(shard_parameters(sizes, self.num_servers), sizes)
            if self.num_servers > 1:
                loads = partition_loads(plan)
                rank_zero_info(
                    f"{type(self).__name__}: {type(optimizer).__qualname__} is not an elementwise optimizer "
                    "(a layer-wise trust ratio needs whole tensors), so each server holds whole tensors: the "
                    f"busiest of {self.num_servers} holds {max(loads) * self.num_servers / max(1, sum(loads)):.2f}x "
                    "the mean. SGD, Adam, AdamW and the other elementwise torch.optim classes are split evenly."
                )
        return optimizer, self._spec, params, plan

    def _start_servers(self) -> None:
        """Build this rank's shard and its client; a barrier makes every shard reachable first."""
        _, spec, params, plan = self._plan_servers()
        self._share_overflow_decision()
        rank = self.global_rank
        if rank < self.num_servers:
            mine = plan[rank]
            register_shard(self._make_shard(rank, mine, [slice_of(params[sl.tensor], sl) for sl in mine], spec))
        log.debug(f"{type(self).__name__}: shard loads (elements) {partition_loads(plan)}")
        # no push may reach a rank before its shard is registered
        self.barrier("ps_shards_ready")
        self._start_client(params, plan)

    def _start_client(self, params: list[Tensor], plan: list[list[Slice]]) -> None:
        """This worker's client, its optimizer's step turned into push/pull, the buffers to share."""
        self._client = self._make_client(params, plan)
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook = self.optimizers[0].register_step_pre_hook(self._step_on_servers)
        assert self.model is not None
        self._buffers = [b for b in self.model.buffers() if self.world_size > 1]

    def _step_on_servers(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The optimizer's step, as the precision plugin calls it: Lightning's closure (forward,
        backward, the ``on_before_optimizer_step`` hooks), then push/pull; the local update that
        follows finds no gradient left (the servers stepped), so it changes nothing.

        A pre-hook (public torch API) keeps every precision plugin's handling as it is: under
        ``16-mixed`` the scaler calls ``step`` only when it does not skip, and torch's LR
        schedulers see the step.
        """
        # torch passes the step's own arguments, the optimizer first
        kwargs = dict(kwargs)
        closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._push_pull(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return args[:1], kwargs

    def _share_overflow_decision(self) -> None:
        """Replace a mixed-precision gradient scaler by an :class:`~lightning_strategies.comm.amp.AgreedGradScaler`
        (same options and state) that decides as ``agree_on_overflow`` says and keeps its decision
        on the device for the logs."""
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler):
            plugin.scaler = AgreedGradScaler.from_scaler(scaler, agree=self.agree_on_overflow)  # type: ignore[attr-defined]

    def _make_shard(
        self, shard_id: int, slices: Sequence[Slice], params: Sequence[Tensor], spec: OptimizerSpec
    ) -> ParameterShard:
        """The shard this rank hosts (a barrier over every worker's push of a step)."""
        return ParameterShard(shard_id, slices, params, spec, self.world_size, timeout=self.ps_timeout)

    def _make_client(self, params: Sequence[Tensor], plan: Sequence[Sequence[Slice]]) -> ParameterServerClient:
        """This worker's handle on every shard."""
        return ParameterServerClient(self.global_rank, params, plan, timeout=self.ps_timeout)

    def _push_pull(self, optimizer: Optimizer) -> None:
        assert self._client is not None
        self._client.push_pull([float(group["lr"]) for group in optimizer.param_groups])

    @override
    def _after_optimizer_step(self) -> None:
        if self._client is None:
            return
        stats = self._client.stats.reset()
        # per-step means over the steps since the last log; the busiest shard: the maximum
        self.metrics.add(**{"comm/bytes_sent": stats.bytes_sent, "comm/bytes_received": stats.bytes_received})
        self.metrics.peak(**{"ps/server_bytes_max": max(self._client.last_server_bytes, default=0)})
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, AgreedGradScaler) and scaler.skipped is not None:
            # a device tensor, read only when the window is logged
            self.metrics.add(**{"amp/step_skipped": scaler.skipped})
            scaler.skipped = None
        self._collect_own_metrics(stats)
        self.metrics.flush_if_due(self.lightning_module)

    def _collect_own_metrics(self, stats: CommStats) -> None:
        """This step's metrics beyond the bytes and the busiest shard (``stats``: the client's)."""
        self.metrics.add(**{"ps/wait_seconds": stats.seconds})

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Broadcast rank 0's buffers (BatchNorm statistics) before the forward, then step.

        DDP does the same before every forward (``broadcast_buffers=True``), so models with
        buffers keep matching it; models without buffers pay nothing.
        """
        if self.broadcast_buffers_each_step and self._buffers:
            broadcast_from_rank0(self._buffers)
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
            kept = self._state_after_fit(optimizer)  # after fit: the servers are gone
            return kept if kept is not None else super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
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
            self._keep_state_at_fit_end()
            self.barrier("ps_state_at_fit_end")  # no shard leaves (teardown) before rank 0 has read it
        super().on_train_end()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Restore each shard's part of the gathered state, and the worker's group options (the
        learning rate the LR schedulers read and write). No collective: a shard steps only once its
        own host's worker has pushed, after this returns."""
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
        """Close this rank's shard with the failure's reason, so peers blocked in its barrier are
        answered at once and name the peer whose loss started the failure."""
        if self._client is not None:
            unregister_shard(self.global_rank, reason=failure_reason(exception))
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Drop the shard and stop RPC: gracefully (no rank closes while a peer still needs its
        shard), or after a failure locally, since the peers may be dead."""
        if self._client is not None:
            self._client = None
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            self._buffers = []
            unregister_shard(self.global_rank)
        if self._rpc_started:
            self._rpc_started = False
            try:
                shutdown_rpc(failed=self.failed, timeout=self.ps_timeout)
            except Exception as err:
                log.warning(f"{type(self).__name__}: RPC shutdown failed: {err}")
                shutdown_rpc(failed=True, timeout=self.ps_timeout, grace_seconds=0.0)
        super().teardown()
