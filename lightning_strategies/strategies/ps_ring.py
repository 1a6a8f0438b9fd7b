"""``RingParameterServerStrategy`` ("ps_ring"): ``"ps"``'s co-located shards, pushed and pulled over the ring.

Every rank hosts the shard the ring's reduce-scatter leaves on it (:mod:`lightning_strategies.comm.ps.ring_shards`):
a bucket's push is comm.ring's reduce-scatter, the shard steps the user's optimizer on its chunk, and the pull is
comm.ring's all-gather. No RPC: the bytes per link are DDP's, and each rank's optimizer steps ``1/P``. The hooks
changed are:

- ``configure_ddp``: no DDP wrapper; check what the shards support, broadcast rank 0's weights.
- ``setup_optimizers``: then the shards (process groups of their own: one ring, or on several nodes the node's
  and the one across nodes) and, with ``overlap``, a hook per tensor.
- ``training_step``: broadcast rank 0's buffers first, as DDP does (BatchNorm statistics).
- ``optimizer_step``: a step pre-hook runs Lightning's closure (buckets go as backward fills them), then waits
  for every bucket's new values; ``block_backward_sync`` holds the pushes while accumulating.
- ``optimizer_state`` / ``load_optimizer_state_dict`` / ``on_train_end``: the shards' state in the worker
  optimizer's format (:mod:`lightning_strategies.comm.ps.ring_shard_state`).
- ``teardown``: stop the shards' thread and drop their group.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_strategies.comm.ps import OptimizerSpec, broadcast_from_rank0
from lightning_strategies.comm.ps.clip import ClipSpec
from lightning_strategies.comm.ps.ring_shard_state import gather_ring_state, load_ring_state
from lightning_strategies.comm.ps.ring_shards import RingShards
from lightning_strategies.strategies._base import StrategyBase, exposed, unwrap_optimizer
from lightning_strategies.strategies._nodes import ring_groups
from lightning_strategies.strategies._ps_clipping import WorkerClippingOff, server_clip_spec
from lightning_strategies.strategies._ps_state import full_optimizer_state
from lightning_strategies.strategies._shard_step import (
    closure_then_exchange,
    require_automatic_optimization,
    require_one_optimizer,
)

__all__ = ["RingParameterServerStrategy"]

log = logging.getLogger(__name__)


class RingParameterServerStrategy(StrategyBase):
    """Synchronous data parallelism through sharded, co-located parameter servers on the ring's two halves.

    DDP's arithmetic with the optimizer on the shards, as ``"ps"`` (every rank hosts ``1/P``), but pushes and
    pulls are comm.ring's reduce-scatter and all-gather per gradient bucket, run on a thread while backward goes
    on, and the values land in the optimizer step. Logged per step: ``comm/bytes_sent``, ``comm/bytes_received``,
    ``ps/wait_seconds`` (the optimizer step's wait for the last buckets) and ``ps/overlap_share`` (the share of
    push bytes queued before backward ended).

    What it takes: one optimizer of an elementwise class (torch.optim's SGD, Adam, AdamW, Adagrad, Adamax,
    NAdam, RAdam, RMSprop, Rprop: a chunk cuts tensors anywhere), trainable tensors of one floating dtype, a
    gradient for every trainable tensor in every step (as DDP without ``find_unused_parameters``), and not
    ``16-mixed`` (use ``bf16-mixed``). Clipping (``gradient_clip_val``, by norm or value) is the shards', on the
    averaged gradient, as DDP's: by norm they agree on the global norm first (one float per rank and step).
    A lost peer fails its ring neighbours (:class:`~lightning_strategies.comm.ring.RingPeerError`), a hung one
    after ``timeout``. On several nodes of several processes the push is hierarchical (``hierarchical``), with
    ``comm/inter_node_bytes_*`` logged too.

    Args:
        overlap: push each bucket as backward fills it; ``False``: every bucket at the optimizer step.
        bucket_cap_mb: a bucket's size in MiB (DDP's; the first is 1 MiB).
        hierarchical: ``None``: on more than one node with more than one process each (nodes as Lightning's
            cluster environment reports them, as the ``"ring"``'s), reduce-scatter in the node, then across nodes
            on the ``1/L`` each process holds; step ``1/(N L)``; all-gather across nodes, then in the node: a
            node's NIC carries the hierarchical ring's bytes. ``True``: the same, logging when nothing is left to
            split; ``False``: one flat ring.
        **kwargs: as for ``DDPStrategy`` (``timeout`` bounds the ring's waits, default 30 minutes).

    Raises:
        ValueError: for a non-positive ``bucket_cap_mb``; at setup, for what the shards cannot run (manual
            optimization, several optimizers, a non-elementwise optimizer, ``16-mixed``, an overridden
            ``configure_gradient_clipping``).
        TypeError: for DDP-wrapper options (``find_unused_parameters``, ...): there is no wrapper.
    """

    strategy_name = "ps_ring"
    wraps_ddp = False

    def __init__(
        self, *, overlap: bool = True, bucket_cap_mb: float = 25.0, hierarchical: bool | None = None, **kwargs: Any
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"RingParameterServerStrategy(bucket_cap_mb={bucket_cap_mb}): expected a positive bucket size in "
                "MiB. Fix: pass e.g. 25 (DDP's default), or overlap=False for one push after the whole backward."
            )
        super().__init__(**kwargs)
        self._overlap = overlap
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._clip: ClipSpec | None = None
        self._shards: RingShards | None = None
        self._hierarchical = hierarchical
        self._is_hierarchical = False
        self._groups: list[dist.ProcessGroup] = []
        self._handles: list[RemovableHandle] = []
        self._buffers: list[Tensor] = []
        self._worker_clipping: WorkerClippingOff | None = None

    hierarchical: bool | None = exposed(
        "_hierarchical", "The ``hierarchical`` setting (``None``: decided from the node layout at setup)."
    )
    is_hierarchical: bool = exposed(
        "_is_hierarchical", "Whether this fit's push is hierarchical (``False`` before setup)."
    )

    @property
    def shards(self) -> RingShards | None:
        """This rank's shards and their exchange (``None`` outside of fitting)."""
        return self._shards

    @override
    def configure_ddp(self) -> None:
        """No DDP wrapper (the shards average): check what they support, then rank 0's weights everywhere."""
        trainer = self.trainer
        assert trainer is not None and self.model is not None
        require_automatic_optimization(type(self).__name__, self._module)
        self._clip = server_clip_spec(type(self).__name__, trainer, self._module, optimizer_norm=False)
        _sync_module_states(self.model)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The optimizers, then (when fitting) this rank's shards."""
        super().setup_optimizers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._start_shards()

    def _start_shards(self) -> None:
        require_one_optimizer(type(self).__name__, self.optimizers)
        if isinstance(getattr(self.precision_plugin, "scaler", None), torch.amp.GradScaler):
            raise ValueError(
                "RingParameterServerStrategy found precision='16-mixed' (a GradScaler): expected no loss scaling, "
                "because a bucket leaves before the whole backward's overflow check. Fix: use precision="
                "'bf16-mixed' (no scaler), or strategy='ps', which agrees on overflows."
            )
        self._stop_shards(failed=False)
        optimizer = self.optimizers[0]
        spec = OptimizerSpec.from_optimizer(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        timeout = self._timeout if self._timeout is not None else default_pg_timeout
        # groups of their own: the shards' thread must never interleave with the main thread's collectives
        backend = self._get_process_group_backend()
        _, self._groups = ring_groups(self, "ps_ring", self._hierarchical, backend=backend, timeout=timeout)
        self._is_hierarchical = len(self._groups) == 2
        self._shards = RingShards(
            params, spec, self._groups[0], bucket_cap_mb=self._bucket_cap_mb, clip=self._clip,
            timeout=timeout.total_seconds() + max(5.0, 0.1 * timeout.total_seconds()),
            inter_group=self._groups[1] if self._is_hierarchical else None,
        )  # fmt: skip
        if self._clip is not None:
            self._worker_clipping = WorkerClippingOff(self.precision_plugin)
        self._handles = [optimizer.register_step_pre_hook(self._step_on_shards)]
        if self._overlap:
            self._handles += self._shards.attach()
        assert self.model is not None
        self._buffers = [b for b in self.model.buffers() if self.world_size > 1]

    def _step_on_shards(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Step pre-hook: Lightning's closure (buckets leave during its backward), then wait for every bucket's
        values; the local update that follows finds no gradient (:func:`~._shard_step.closure_then_exchange`)."""
        assert self._shards is not None
        self._shards.begin_step(optimizer.param_groups)  # this step's options (a scheduler set them)
        return closure_then_exchange(optimizer, args, kwargs, self._shards.flush)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Broadcast rank 0's buffers (BatchNorm statistics) before the forward, as DDP does, then step."""
        if self._buffers:
            broadcast_from_rank0(self._buffers)
        return super().training_step(*args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches push nothing, as DDP's ``no_sync``: the stepping one pushes the sum."""
        shards = self._shards
        if shards is None:
            yield
            return
        shards.enabled = False
        try:
            yield
        finally:
            shards.enabled = True

    @override
    def _after_optimizer_step(self) -> None:
        if self._shards is None:
            return
        stats = self._shards.stats.reset()
        self.metrics.add(**{"comm/bytes_sent": stats.bytes_sent, "comm/bytes_received": stats.bytes_received})
        if stats.inter_node_bytes_sent is not None and stats.inter_node_bytes_received is not None:
            self.metrics.add(**{"comm/inter_node_bytes_sent": stats.inter_node_bytes_sent,
                                "comm/inter_node_bytes_received": stats.inter_node_bytes_received})  # fmt: skip
        last = self._shards.last
        self.metrics.add(**{"ps/wait_seconds": last.wait_seconds, "ps/overlap_share": last.overlap_share})
        self.metrics.flush_if_due(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The shards' optimizer state gathered in the worker optimizer's format, on rank 0 (a collective: every
        rank calls it, as ``Trainer.save_checkpoint`` does). It loads into a single-device optimizer too; each
        group's ``lr`` is the worker's, the one its scheduler set for the next step."""
        if self._shards is None:
            kept = self._state_after_fit(optimizer)  # after fit: the shards are gone
            return kept if kept is not None else super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        state = gather_ring_state(self._shards, optimizer.state_dict()["param_groups"])
        return state if self.is_global_zero else {}

    @override
    def on_train_end(self) -> None:
        # the shards and their state go at teardown, and the worker optimizer never steps: keep it for a
        # Trainer.save_checkpoint after fit
        if self._shards is not None and self.optimizers:
            self._keep_state_at_fit_end()
        super().on_train_end()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each shard's part of the state, and the worker's group options (the LR schedulers use). No collective."""
        if self._shards is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        full = full_optimizer_state(type(self).__name__, checkpoint)
        self.optimizers[0].load_state_dict({"state": {}, "param_groups": full["param_groups"]})
        load_ring_state(self._shards, full)

    def _stop_shards(self, *, failed: bool) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        stopped = self._shards.close(timeout=0.0 if failed else 10.0) if self._shards is not None else True
        self._shards = None
        if stopped and not failed and dist.is_initialized():
            for group in self._groups:
                dist.destroy_process_group(group)
        self._groups = []

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Stop the shards without waiting: a lost peer may hold a ring call up for the whole timeout."""
        self._stop_shards(failed=True)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Stop the shards' thread and drop its group (left alone after a failure: a peer may be gone)."""
        self._stop_shards(failed=self.failed)
        self._buffers = []
        if self._worker_clipping is not None:
            self._worker_clipping.restore()
            self._worker_clipping = None
        super().teardown()
