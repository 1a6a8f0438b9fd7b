"""``"ring"``: Lightning's DDP with every gradient bucket reduced by our ring all-reduce.

DDP keeps bucketing, overlap with backward and ``no_sync``; a DDP communication hook hands each bucket to
:class:`~lightning_strategies.comm.ring.RingBucketReducer` (a background thread and a process group of its own).
The hooks changed: ``_setup_model`` (the bucket size), ``_register_ddp_hooks`` (the ring as the hook, on CPU
too), ``_after_optimizer_step`` (the ``comm/*`` metrics) and ``teardown`` (the reducer and its groups).
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with its types as objects.

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel.distributed import DistributedDataParallel
from typing_extensions import override

from lightning_strategies.comm.ring import (
    MIN_CHUNK_BYTES,
    WIRE_DTYPES,
    NodeLayout,
    RingBucketReducer,
    resolve_wire_dtype,
    ring_bucket_cap_mb,
)
from lightning_strategies.strategies._base import StrategyBase, exposed, log_due
from lightning_strategies.strategies._nodes import ring_groups

__all__ = ["RingAllReduceStrategy"]

log = logging.getLogger(__name__)

_DDP_HOOK_OPTIONS = ("ddp_comm_hook", "ddp_comm_wrapper", "ddp_comm_state", "model_averaging_period")


class RingAllReduceStrategy(StrategyBase):
    """Data-parallel training whose gradients are averaged by a ring all-reduce.

    Registered as ``"ring"``, ``"ring_bf16"`` (``wire_dtype="bf16"``) and ``"ring_hier"`` (``hierarchical=True``).
    Launching, cluster environments, ``no_sync`` and checkpointing are DDP's; nodes are the launcher's
    (:class:`~lightning_strategies.comm.ring.NodeLayout`). Logged per step (means since the last log):
    ``comm/bytes_sent``, ``comm/bytes_received``, ``comm/calls``, ``comm/seconds`` (the reducer's wall time on
    CPU, CUDA-event time on CUDA) and, on more than one node, ``comm/inter_node_bytes_*`` /
    ``comm/intra_node_bytes_*``. On a fault a dead peer's ring neighbours fail at once
    (:class:`~lightning_strategies.comm.ring.RingPeerError`), a hung one's after ``timeout``; every survivor's
    error names the lost rank(s).

    Args:
        bucket_cap_mb: DDP bucket size in MiB, one ring call each (bigger: fewer calls, later overlap with backward).
        wire_dtype: ``None`` (the gradients' own), ``"bf16"`` or ``"fp16"``: chunks sent in that type, summed in theirs.
        hierarchical: ``None``: hierarchical (:func:`~lightning_strategies.comm.ring.hierarchical_all_reduce`)
            on more than one node with more than one process each; ``True``: the same, logging when nothing is
            left to split; ``False``: always one flat ring.
        min_chunk_bytes: the smallest chunk a ring step should move: the bucket grows to
            ``world_size x min_chunk_bytes`` when larger; ``0`` keeps ``bucket_cap_mb``.
        timeout: process-group timeout, the ring's own group's too (default 30 minutes, as DDP).
        **kwargs: everything else ``DDPStrategy`` takes (``start_method``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: for an invalid ``wire_dtype``, ``bucket_cap_mb``, ``hierarchical`` or ``min_chunk_bytes``,
            or a DDP communication-hook option (the ring *is* the hook); at setup, for nodes with different
            numbers of processes under a hierarchical ring, or node ranks that disagree with ``num_nodes``.
    """

    strategy_name = "ring"

    def __init__(
        self,
        *,
        bucket_cap_mb: float = 25.0,
        wire_dtype: str | None = None,
        hierarchical: bool | None = None,
        min_chunk_bytes: int = MIN_CHUNK_BYTES,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"Invalid bucket_cap_mb={bucket_cap_mb!r}: expected a positive number of MiB.")
        if hierarchical is not None and type(hierarchical) is not bool:
            raise ValueError(
                f"Invalid hierarchical={hierarchical!r}: expected None (hierarchical on more than one node), "
                "True or False."
            )
        if type(min_chunk_bytes) is not int or min_chunk_bytes < 0:
            raise ValueError(
                f"Invalid min_chunk_bytes={min_chunk_bytes!r}: expected an integer number of bytes >= 0 "
                "(0: keep bucket_cap_mb)."
            )
        if wire_dtype is not None and not isinstance(wire_dtype, str):
            raise ValueError(f"Invalid wire_dtype {wire_dtype!r}: expected None or one of {sorted(WIRE_DTYPES)}.")
        resolve_wire_dtype(wire_dtype)  # raises with the valid names listed
        if clash := sorted(k for k in _DDP_HOOK_OPTIONS if kwargs.get(k) is not None):
            raise ValueError(
                f"RingAllReduceStrategy got {clash}, but the ring is itself the DDP communication hook. "
                "Use DDPStrategy for a custom hook or post-local SGD, or drop these arguments."
            )
        super().__init__(timeout=timeout, bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._wire_dtype = wire_dtype
        self._hierarchical = hierarchical
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._min_chunk_bytes = min_chunk_bytes
        self._reducer: RingBucketReducer | None = None
        self._ring_groups: list[dist.ProcessGroup] = []
        self._layout: NodeLayout | None = None
        self._is_hierarchical = False
        self._device_calls = [0, 0]  # CUDA: ring calls and optimizer steps since the last logged window

    wire_dtype: str | None = exposed("_wire_dtype", "The wire dtype name gradients are sent in (``None``: their own).")
    hierarchical: bool | None = exposed(
        "_hierarchical", "The ``hierarchical`` setting (``None``: decided from the node layout at setup)."
    )
    is_hierarchical: bool = exposed(
        "_is_hierarchical", "Whether the ring set up for this fit is hierarchical (``False`` before setup)."
    )
    node_layout: NodeLayout | None = exposed(
        "_layout", "Which ranks share a node, from Lightning's cluster environment (``None`` before setup)."
    )

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        cap = ring_bucket_cap_mb(self._bucket_cap_mb, self.world_size, self._min_chunk_bytes)
        if cap != self._bucket_cap_mb:
            rank_zero_info(
                f"ring: DDP buckets of {cap:g} MiB instead of {self._bucket_cap_mb:g}, so each of the ring's "
                f"{self.world_size} chunks per bucket carries at least min_chunk_bytes={self._min_chunk_bytes}"
            )
        self._ddp_kwargs["bucket_cap_mb"] = cap
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers a hook only on CUDA; the ring must run on CPU/gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        self._close_reducer()
        # Every rank gets here in the same order (fit setup), as the all-gather and new_group need. Groups of
        # its own: the reducer thread's messages must never interleave with the main thread's collectives.
        backend = self._get_process_group_backend()
        layout, self._ring_groups = ring_groups(
            self, "ring", self._hierarchical, backend=backend, timeout=self._timeout
        )
        self._layout = layout
        self._is_hierarchical = len(self._ring_groups) == 2
        if self._is_hierarchical:
            intra, inter = self._ring_groups
            self._reducer = RingBucketReducer(intra, op="avg", wire_dtype=self._wire_dtype, inter_group=inter)
        else:
            split = layout if layout.num_nodes > 1 else None  # on one node every byte stays inside it
            self._reducer = RingBucketReducer(self._ring_groups[0], op="avg", wire_dtype=self._wire_dtype, layout=split)
        self.model.register_comm_hook(state=None, hook=self._ring_hook)

    def _ring_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: queue the bucket for the ring, return its future. DDP calls it in bucket
        order on every rank and the reducer thread keeps that order, so all ranks meet in the same ring call;
        DDP waits for the futures at the end of backward (and raises there if a call failed)."""
        assert self._reducer is not None
        return self._reducer.submit(bucket.buffer())

    @override
    def _after_optimizer_step(self) -> None:
        # after the closure: DDP waited for every bucket's future (no_sync micro-steps reduce nothing)
        if self._reducer is None:
            return
        stats = self._reducer.pop_stats()
        values = stats.as_dict("comm/")
        if self.root_device.type == "cuda":
            # device time: read at the logging step for finished calls only (no wait), as mean per call x calls/step
            del values["comm/seconds"]
            self._device_calls[0] += stats.calls
            self._device_calls[1] += 1
            if log_due(self.trainer) is not None:
                seconds, timed = self._reducer.pop_device_seconds()
                calls, steps = self._device_calls
                if timed:
                    self.metrics.latest(**{"comm/seconds": seconds / timed * calls / steps})
                self._device_calls = [0, 0]
        self.metrics.add(**values)
        self.metrics.flush_if_due(self.lightning_module)

    def _close_reducer(self) -> None:
        stopped = self._reducer.close() if self._reducer is not None else True
        self._reducer = None
        if stopped and dist.is_initialized():
            for group in self._ring_groups:
                dist.destroy_process_group(group)
        self._ring_groups = []
        self._device_calls = [0, 0]

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: closing the ring reducer")
        self._close_reducer()
        super().teardown()
