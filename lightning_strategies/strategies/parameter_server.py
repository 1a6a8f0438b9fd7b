"""``ParameterServerStrategy`` ("parameter_server", "ps"): synchronous sharded parameter servers.

DDP without its wrapper; every rank also hosts a shard, over TensorPipe RPC (:mod:`lightning_strategies.comm.ps`),
and a worker's optimizer step becomes "push gradients, pull new values". The hooks changed are:

- ``setup_environment``: start RPC after the process group (its own rendezvous port).
- ``configure_ddp``: no DDP wrapper; check what the servers support, broadcast rank 0's weights.
- ``setup_optimizers``: then this rank's shard and its client (``_make_shard`` / ``client_class``: ``"async"``'s).
- ``training_step``: broadcast rank 0's buffers first, as DDP does (BatchNorm statistics).
- ``optimizer_step``: the optimizer's step runs Lightning's closure, then push/pull instead of a local
  update (a step pre-hook); its metrics are collected after the step (``_after_optimizer_step``). With
  ``overlap`` the buckets are pushed during the closure's backward and the values land before each
  module's forward (:mod:`._ps_overlap`); ``block_backward_sync`` holds the pushes while accumulating.
- ``lightning_module_state_dict`` / ``on_validation_start`` / ``on_test_start`` / ``on_predict_start``:
  first every value in flight lands (:class:`._ps_overlap.PushOverlapMixin`).
- ``optimizer_state`` / ``load_optimizer_state_dict``: gather / scatter the shards' state; ``on_train_end``
  keeps the gathered state for a ``Trainer.save_checkpoint`` after fit.
- ``teardown``: shut RPC down (gracefully unless the run failed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
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
    partition_loads,
    partition_parameters,
    register_shard,
    shard_parameters,
    slice_of,
    unregister_shard,
    whole_tensor_slices,
)
from lightning_strategies.comm.ps.clip import ClipSpec, ShardClipping
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc, worker_name
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.strategies._base import StrategyBase
from lightning_strategies.strategies._ps_clipping import WorkerClippingOff, global_norm_max, server_clip_spec
from lightning_strategies.strategies._ps_nodes import (
    PushAlignment,
    PushNodes,
    check_align_pushes,
    check_hierarchical,
    check_reply_per_bucket,
    close_alignment,
    close_push_nodes,
    plan_alignment,
    plan_push_nodes,
)
from lightning_strategies.strategies._ps_overlap import OverlapHooks, PushOverlapMixin
from lightning_strategies.strategies._ps_state import ShardStateMixin
from lightning_strategies.strategies._shard_step import (
    closure_then_exchange,
    require_automatic_optimization,
    require_one_optimizer,
)

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger(__name__)


class ParameterServerStrategy(ShardStateMixin, PushOverlapMixin, StrategyBase):
    """Synchronous data parallelism through sharded, co-located parameter servers.

    Each step every worker pushes its gradients to the shards, each shard averages them over all workers,
    runs the user's optimizer on its slice and answers with the new values: DDP's arithmetic, with the
    optimizer on the servers; the worker's learning rates travel with the pushes. Under ``16-mixed`` an
    overflow on any rank skips the step everywhere (:class:`~lightning_strategies.comm.amp.AgreedGradScaler`).
    Logged per step: ``comm/bytes_sent``, ``comm/bytes_received``, ``ps/server_bytes_max``, ``ps/wait_seconds``
    (with ``overlap``: the time blocked waiting for values) and, under ``16-mixed``, ``amp/step_skipped``.

    - ``overlap`` (:mod:`._ps_overlap`): gradient buckets go out as backward fills them and each module waits
      before its next forward only for its own shards; everything else that reads the weights waits for all
      (a callback between steps calls :meth:`wait_for_pulls`). Not under ``16-mixed`` (the overflow check
      needs the whole backward). Under the hierarchical push each bucket is reduced in the node, then pushed.
    - ``hierarchical`` (:mod:`~lightning_strategies.comm.ps.hierarchy`): on several nodes, reduced in the node,
      ``1/L`` pushed across by each local rank, the values all-gathered in the node.
    - Clipping (:mod:`._ps_clipping`): the shards clip the averaged gradient as DDP does (by norm, agreeing on
      the global norm first); ``Lamb(max_grad_norm=...)`` gets that norm too.
    - Faults: the survivors' errors name the lost rank(s); RPC shuts down without them. More: docs/strategies/ps.md.

    Args:
        num_servers: shards, hosted by ranks ``0 .. num_servers-1``; default the world size (every rank serves
            ``1/P`` of the parameters).
        rpc_threads: RPC server threads per process. Handlers never block, so a few suffice; each extra
            thread competes with training for the cores.
        hierarchical: ``None``: the hierarchical push on more than one node with more than one process each
            (nodes as Lightning's cluster environment reports them, as the ``"ring"``'s); ``True``: the same,
            logging when nothing is left to split; ``False``: every worker pushes to every shard.
        align_pushes: ``None``: where the push is flat and crosses nodes, every worker waits before each step's
            first push until all have their values of the last step (a gloo barrier): a worker that got its values
            first would otherwise push while its own shard still sends replies to the others over the same link
            (on the emulated 4 x 1 cluster: 0.85 / 0.98 / 0.98 of the unaligned wall time per step at 50mbit /
            200mbit / 1gbit, a clear gain at 50mbit only; docs/measured/cluster.md); ``True``: always (more than
            one process); ``False``: never.
        overlap: push during backward and pull during the next forward; ``False``: push after the whole
            backward and wait for every shard in the optimizer step.
        reply_per_bucket: split every push bucket over every shard, and have a shard step and answer a bucket as
            soon as every worker has pushed it, so the first buckets' values travel back while later ones are still
            pushed (the same weights as one step per shard). It needs ``overlap``, the flat push, an elementwise
            optimizer (:attr:`~lightning_strategies.comm.ps.OptimizerSpec.elementwise`) and no clipping.
            ``None``: where those hold and the push crosses nodes (on the emulated 4 x 1 cluster 0.98 / 0.97 / 0.83
            of one reply per shard's wall time per step at 50mbit / 200mbit / 1gbit; on one node it costs CPU:
            1.10 x the step; docs/measured/cluster.md); ``True``: also on one node, raising where it cannot apply;
            ``False``: one step and one reply per shard.
        bucket_cap_mb: the size of a push bucket under ``overlap`` (DDP's; the first bucket is 1 MiB).
        **kwargs: as for ``DDPStrategy``; ``timeout`` bounds the wait of collectives and a shard's barrier for a
            hung peer (default 30 minutes; RPCs wait ``timeout`` + max(5 s, 10%), so the shard's error comes first).

    Raises:
        ValueError: for invalid options; at setup, for what the servers cannot run (manual optimization, several
            optimizers, an overridden ``configure_gradient_clipping``, a ``max_grad_norm`` optimizer other than
            :class:`~lightning_strategies.optim.Lamb` over several shards, more servers than processes, uneven
            nodes under ``hierarchical=True``).
        TypeError: for DDP-wrapper options (``find_unused_parameters``, ...): there is no wrapper.
    """

    strategy_name = "parameter_server"
    # DDP's broadcast of rank 0's buffers before every forward; it pairs the ranks' steps, so "async" turns it off
    broadcast_buffers_each_step: ClassVar[bool] = True
    # Under 16-mixed every rank skips an overflowing step together: a rank that skipped alone would never
    # push, and the shards' barrier would wait for it. Async, with no barrier, lets each rank skip alone.
    agree_on_overflow: ClassVar[bool] = True
    #: The shards clip the averaged gradient as DDP's Lightning does, the worker not at all ("async": each worker
    #: clips its own gradient, which is one step's alone).
    clips_on_servers: ClassVar[bool] = True
    #: Each worker's push/pull handle ("async" swaps in its asynchronous client).
    client_class: ClassVar[type[ParameterServerClient]] = ParameterServerClient
    #: Whether the node's pushes may be reduced first ("async" pushes without a barrier: nothing to reduce in).
    hierarchical_push: ClassVar[bool] = True
    #: Whether ``overlap`` applies (a barrier per step: "async" pushes and pulls on its own schedule).
    overlap_supported: ClassVar[bool] = True
    #: Whether ``align_pushes`` applies (a step every worker takes together: not "async"'s).
    aligns_pushes: ClassVar[bool] = True

    wraps_ddp = False

    def __init__(
        self,
        *,
        num_servers: int | None = None,
        rpc_threads: int = 4,
        hierarchical: bool | None = None,
        align_pushes: bool | None = None,
        overlap: bool = True,
        reply_per_bucket: bool | None = None,
        bucket_cap_mb: float = 25.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_hierarchical(type(self), hierarchical)
        check_align_pushes(type(self), align_pushes)
        check_reply_per_bucket(type(self), reply_per_bucket, overlap=overlap)
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"ParameterServerStrategy(bucket_cap_mb={bucket_cap_mb}): expected a positive bucket size in MiB. "
                "Fix: pass e.g. 25 (DDP's default), or overlap=False for one push after the whole backward."
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
        self._hierarchical = hierarchical if self.hierarchical_push else False
        self._push_nodes: PushNodes | None = None
        self._align_pushes = align_pushes if self.aligns_pushes else False
        self._alignment: PushAlignment | None = None
        self._rpc_started = False
        self._client: ParameterServerClient | None = None
        self._spec: OptimizerSpec | None = None
        self._step_hook: RemovableHandle | None = None
        self._buffers: list[Tensor] = []  # rank 0's are broadcast (each step, or at sync points)
        self._global_norm_max: float | None = None  # Lamb(max_grad_norm) over several shards
        self._server_clip: ClipSpec | None = None  # what the shards clip ("ps")
        self._norm_shards: list[int] = []
        self._worker_clipping: WorkerClippingOff | None = None
        self._overlap_option = overlap
        self._reply_per_bucket = reply_per_bucket
        self._bucket_cap_mb = bucket_cap_mb

    @property
    def num_servers(self) -> int:
        """Shard count in effect: the ``num_servers`` option, or the world size."""
        return self._num_servers if self._num_servers is not None else self.world_size

    @property
    def is_hierarchical(self) -> bool:
        """Whether this fit's push is hierarchical (``False`` outside of fitting; ``hierarchical`` decides)."""
        return self._push_nodes is not None

    @property
    def is_aligned(self) -> bool:
        """Whether this fit's workers align each step's pushes (``False`` outside of fitting; ``align_pushes``
        decides)."""
        return self._alignment is not None

    @property
    def ps_timeout(self) -> timedelta:
        """The timeout of the shards' barrier (and the base of the RPC timeout)."""
        return self._timeout if self._timeout is not None else default_pg_timeout

    @property
    def client(self) -> ParameterServerClient | None:
        """This worker's push/pull handle (``None`` outside of fitting)."""
        return self._client

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
        """Start the RPC agent, meeting in a store of its own on a kernel-chosen port (not ``MASTER_PORT``'s)."""
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

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper (the servers average): check what they support, then rank 0's weights everywhere."""
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
        require_automatic_optimization(type(self).__name__, module)
        if self.clips_on_servers:  # refuses a custom configure_gradient_clipping (it cannot run on the shards)
            self._server_clip = server_clip_spec(type(self).__name__, trainer, module, optimizer_norm=False)

    def _plan_servers(self) -> tuple[Optimizer, OptimizerSpec, list[Tensor], list[list[Slice]]]:
        """The optimizer, its rebuild spec, its parameters and the shard plan (:func:`_shard_plan`)."""
        require_one_optimizer(type(self).__name__, self.optimizers)
        optimizer = self.optimizers[0]
        self._spec = OptimizerSpec.from_optimizer(optimizer)
        # LAMB (timm-style) clips by the norm over *all* its tensors, and each shard sees a slice
        self._global_norm_max = global_norm_max(type(self).__name__, optimizer, self._spec, self.num_servers)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        plan = _shard_plan(type(self).__name__, optimizer, self._spec, [p.numel() for p in params], self.num_servers)
        return optimizer, self._spec, params, plan

    def _start_servers(self) -> None:
        _, spec, params, plan = self._plan_servers()
        if self.clips_on_servers:
            if self._global_norm_max is not None or self._server_clip is not None:
                optimizer_norm = self._global_norm_max is not None
                self._server_clip = replace(self._server_clip or ClipSpec(), optimizer_norm=optimizer_norm)
                self._norm_shards = [s for s, slices in enumerate(plan) if slices]  # the shards that get pushes
            self._worker_clipping = WorkerClippingOff(self.precision_plugin)
        self._share_overflow_decision()
        close_push_nodes(self._push_nodes, self._client, failed=False)
        backend, timeout = self._get_process_group_backend(), self._timeout
        self._push_nodes = plan_push_nodes(
            self, self._hierarchical, num_servers=self.num_servers, backend=backend, timeout=timeout
        )
        close_alignment(self._alignment)
        self._alignment = plan_alignment(
            self, self._align_pushes, flat=self._push_nodes is None, backend=backend, timeout=timeout
        )
        clipping = self._server_clip is not None
        plan = self._plan_replies(spec, params, plan, flat=self._push_nodes is None, clipping=clipping)
        rank = self.global_rank
        if rank < self.num_servers:
            mine = plan[rank]
            register_shard(self._make_shard(rank, mine, [slice_of(params[sl.tensor], sl) for sl in mine], spec))
        log.debug(f"{type(self).__name__}: shard loads (elements) {partition_loads(plan)}")
        # no push may reach a rank before its shard is registered
        self.barrier("ps_shards_ready")
        self._start_client(params, plan)

    def _start_client(self, params: list[Tensor], plan: list[list[Slice]]) -> None:
        if self._push_nodes is not None:
            self._client = self._push_nodes.client(self.global_rank, params, plan, timeout=self.ps_timeout)
        else:
            self._client = self.client_class(self.global_rank, params, plan, timeout=self.ps_timeout)
        self._client.align = self._alignment
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook = self.optimizers[0].register_step_pre_hook(self._step_on_servers)
        assert self.model is not None
        self._buffers = [b for b in self.model.buffers() if self.world_size > 1]
        if self._overlaps():
            cap = self._bucket_cap_mb
            self._overlap = OverlapHooks(
                self._client,
                self.optimizers[0],
                self.model,
                bucket_cap_mb=cap,
                replies_per_bucket=self._replies_per_bucket,
            )

    def _step_on_servers(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Step pre-hook: Lightning's closure, then push/pull; the local update that follows finds no gradient
        (the servers stepped; :func:`~._shard_step.closure_then_exchange`)."""
        return closure_then_exchange(optimizer, args, kwargs, lambda: self._push_pull(optimizer))

    def _share_overflow_decision(self) -> None:
        """Swap in an :class:`~lightning_strategies.comm.amp.AgreedGradScaler`, deciding as ``agree_on_overflow``."""
        plugin = self.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler):
            plugin.scaler = AgreedGradScaler.from_scaler(scaler, agree=self.agree_on_overflow)  # type: ignore[attr-defined]

    def _make_shard(
        self, shard_id: int, slices: Sequence[Slice], params: Sequence[Tensor], spec: OptimizerSpec
    ) -> ParameterShard:
        clip, timeout = self._server_clip, self.ps_timeout
        clipping = ShardClipping(clip, shard_id, self._norm_shards, timeout=timeout) if clip is not None else None
        # under the hierarchical push one pusher per node, pushing node sums already divided by P
        pushers = self._push_nodes.pushers_of(shard_id) if self._push_nodes is not None else None
        width = self.world_size if pushers is None else len(pushers)
        return ParameterShard(
            shard_id, slices, params, spec, width, timeout=timeout, pusher_ranks=pushers, average=pushers is None,
            clipping=clipping, reply_per_part=self._replies_per_bucket,
        )  # fmt: skip

    def _push_pull(self, optimizer: Optimizer) -> None:
        assert self._client is not None
        if self._overlap is not None:
            self._overlap.push.end_backward()
            self._overlap.push.flush()  # the values land before each module's next forward
            return
        self._client.push_pull([float(group["lr"]) for group in optimizer.param_groups])

    @override
    def _after_optimizer_step(self) -> None:
        if self._client is None:
            return
        stats = self._client.stats.reset()
        self.metrics.add(**{"comm/bytes_sent": stats.bytes_sent, "comm/bytes_received": stats.bytes_received})
        if stats.inter_node_bytes_sent is not None and stats.inter_node_bytes_received is not None:
            self.metrics.add(**{"comm/inter_node_bytes_sent": stats.inter_node_bytes_sent,
                                "comm/inter_node_bytes_received": stats.inter_node_bytes_received})  # fmt: skip
        self.metrics.peak(**{"ps/server_bytes_max": max(self._client.last_server_bytes, default=0)})
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, AgreedGradScaler) and scaler.skipped is not None:
            # a device tensor, read only when the window is logged
            self.metrics.add(**{"amp/step_skipped": scaler.skipped})
            scaler.skipped = None
        self._collect_own_metrics(stats)
        self.metrics.flush_if_due(self.lightning_module)
        self._settle_at_epoch_end()  # after the metrics: a step's window counts the values that landed in it

    def _collect_own_metrics(self, stats: CommStats) -> None:
        """This step's metrics beyond the bytes and the busiest shard (``stats``: the client's)."""
        self.metrics.add(**{"ps/wait_seconds": stats.seconds})

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Broadcast rank 0's buffers (BatchNorm statistics) before the forward, as DDP does, then step."""
        if self.broadcast_buffers_each_step and self._buffers:
            broadcast_from_rank0(self._buffers)
        if self._overlap is not None:
            self._overlap.before_training_step()
        return super().training_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Close this rank's shard with the failure's reason: peers in its barrier fail at once, naming the lost one;
        and its node's push groups, so that node peers waiting for it in the node's collective fail at once too."""
        self._settle_quietly(failed=True)  # no wait: a lost peer may hold a reply up for the whole timeout
        if self._client is not None:
            unregister_shard(self.global_rank, reason=failure_reason(exception))
        close_push_nodes(self._push_nodes, self._client, failed=True)
        self._push_nodes = None
        close_alignment(self._alignment)
        self._alignment = None
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Drop the shard, stop RPC: gracefully (no rank leaves while a peer needs it), or locally if the run failed."""
        self._remove_overlap()
        if self._client is not None:
            self._client = None
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            self._buffers = []
            unregister_shard(self.global_rank)
        close_push_nodes(self._push_nodes, self._client, failed=self.failed)
        self._push_nodes = None
        close_alignment(self._alignment)
        self._alignment = None
        if self._worker_clipping is not None:
            self._worker_clipping.restore()
            self._worker_clipping = None
        if self._rpc_started:
            self._rpc_started = False
            try:
                shutdown_rpc(failed=self.failed, timeout=self.ps_timeout)
            except Exception as err:
                log.warning(f"{type(self).__name__}: RPC shutdown failed: {err}")
                shutdown_rpc(failed=True, timeout=self.ps_timeout, grace_seconds=0.0)
        super().teardown()


def _shard_plan(
    name: str, optimizer: Optimizer, spec: OptimizerSpec, sizes: list[int], num_servers: int
) -> list[list[Slice]]:
    """Equal ranges of the flattened parameters for an elementwise optimizer, whole tensors per server for a
    layer-wise one (LAMB, LARS), said once on rank 0 with how uneven that leaves the servers."""
    if spec.elementwise:
        return partition_parameters(sizes, num_servers)
    plan = whole_tensor_slices(shard_parameters(sizes, num_servers), sizes)
    if num_servers > 1:
        loads = partition_loads(plan)
        rank_zero_info(
            f"{name}: {type(optimizer).__qualname__} is not an elementwise optimizer "
            "(a layer-wise trust ratio needs whole tensors), so each server holds whole tensors: the "
            f"busiest of {num_servers} holds {max(loads) * num_servers / max(1, sum(loads)):.2f}x "
            "the mean. SGD, Adam, AdamW and the other elementwise torch.optim classes are split evenly."
        )
    return plan
