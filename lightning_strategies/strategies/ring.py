"""``"ring"``: Lightning's DDP with every gradient bucket reduced by our ring all-reduce.

DDP keeps doing what it is good at (bucketing gradients, launching a bucket's reduction as
soon as backward has produced it, so communication overlaps the rest of backward, and
``no_sync`` for gradient accumulation). Only *how* a bucket is reduced changes: a DDP
communication hook hands it to :class:`~lightning_strategies.comm.ring.RingBucketReducer`,
which runs :func:`~lightning_strategies.comm.ring.ring_all_reduce` on a background thread and
a process group of its own.
"""

# No ``from __future__ import annotations`` here: DDP compares the hook's annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.nn.parallel.distributed import DistributedDataParallel
from typing_extensions import override

from lightning_strategies.comm.ring import WIRE_DTYPES, RingBucketReducer, resolve_wire_dtype
from lightning_strategies.strategies._base import StrategyBase

__all__ = ["RingAllReduceStrategy"]

log = logging.getLogger(__name__)

_DDP_HOOK_OPTIONS = ("ddp_comm_hook", "ddp_comm_wrapper", "ddp_comm_state", "model_averaging_period")


class RingAllReduceStrategy(StrategyBase):
    """Data-parallel training whose gradients are averaged by a ring all-reduce.

    Registered as ``"ring"`` (and ``"ring_bf16"`` = ``wire_dtype="bf16"``) on
    ``import lightning_strategies``. Launching, multi-node cluster environments
    (torchrun, SLURM, ...), ``no_sync`` gradient accumulation and checkpointing are DDP's.

    Logged at Lightning's step-logging cadence (``Trainer(log_every_n_steps=...)``), as per-step
    means over the optimizer steps since the last log: this rank's ``comm/bytes_sent``,
    ``comm/bytes_received``, ``comm/calls`` and ``comm/seconds`` (time inside the ring, on the
    reducer thread), through ``LightningModule.log``, so they reach ``trainer.callback_metrics``
    and the logger (which writes rank 0's).

    On a fault: a peer that dies closes its connections, so its ring neighbours fail at once
    (:class:`~lightning_strategies.comm.ring.RingPeerError`, naming the neighbour); a peer that
    hangs fails them after ``timeout``. Either way every survivor's error names the lost rank(s)
    from their heartbeats (``"ring: lost peer rank 1 of 4: ..."``, :mod:`lightning_strategies.faults`):
    a :class:`~lightning_strategies.PeerLostError` when a training step failed, else the
    diagnosis as a note on the error; teardown does not wait for the dead peer.

    Args:
        bucket_cap_mb: DDP bucket size in MiB: each bucket is one ring call. Bigger buckets
            mean fewer calls but later overlap with backward.
        wire_dtype: ``None`` (send gradients in their own dtype), ``"bf16"`` or ``"fp16"``:
            send chunks in that type and accumulate in the gradient's dtype (compression).
        timeout: process-group timeout, also of the ring's own group: a stuck peer fails the
            step after this long instead of hanging (default 30 minutes, as DDP; a dead one
            fails it at once).
        **kwargs: everything else ``DDPStrategy`` takes (``start_method``,
            ``find_unused_parameters``, ``static_graph``, ``process_group_backend``, ...).

    Raises:
        ValueError: for an invalid ``wire_dtype`` or ``bucket_cap_mb``, or a DDP
            communication-hook option (the ring *is* the hook).
    """

    strategy_name = "ring"

    def __init__(
        self,
        *,
        bucket_cap_mb: float = 25.0,
        wire_dtype: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"Invalid bucket_cap_mb={bucket_cap_mb!r}: expected a positive number of MiB.")
        if wire_dtype is not None and not isinstance(wire_dtype, str):
            raise ValueError(f"Invalid wire_dtype {wire_dtype!r}: expected None or one of {sorted(WIRE_DTYPES)}.")
        resolve_wire_dtype(wire_dtype)  # raises with the valid names listed
        clash = sorted(k for k in _DDP_HOOK_OPTIONS if kwargs.get(k) is not None)
        if clash:
            raise ValueError(
                f"RingAllReduceStrategy got {clash}, but the ring is itself the DDP communication hook. "
                "Use DDPStrategy for a custom hook or post-local SGD, or drop these arguments."
            )
        super().__init__(timeout=timeout, bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._wire_dtype = wire_dtype
        self._reducer: RingBucketReducer | None = None
        self._ring_group: dist.ProcessGroup | None = None

    @property
    def wire_dtype(self) -> str | None:
        """The wire dtype name gradients are sent in (``None``: their own dtype)."""
        return self._wire_dtype

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers a hook only on CUDA; the ring must run on CPU/gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        self._close_reducer()
        # Every rank reaches this line in the same order (setup of the fit), as new_group needs.
        # A group of its own: the reducer thread's messages must never interleave with
        # collectives that the main thread runs on the default group meanwhile.
        group = dist.new_group(timeout=self._timeout, backend=self._get_process_group_backend())
        assert isinstance(group, dist.ProcessGroup)
        self._ring_group = group
        self._reducer = RingBucketReducer(group, op="avg", wire_dtype=self._wire_dtype)
        self.model.register_comm_hook(state=None, hook=self._ring_hook)

    def _ring_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: queue the bucket for the ring and return its future.

        Called by DDP's reducer during backward, in bucket-index order on every rank; the
        reducer thread keeps that order, so all ranks meet in the same ring call. DDP waits for
        the futures at the end of backward, and raises there if a ring call failed.
        """
        assert self._reducer is not None
        return self._reducer.submit(bucket.buffer())

    @override
    def _after_optimizer_step(self) -> None:
        # After the closure (forward + backward, so every bucket of this step has been reduced:
        # DDP waited for the futures). Steps that only accumulate gradients under no_sync reduce
        # nothing and are summed into the next optimizer step.
        if self._reducer is None:
            return
        self.metrics.add(**self._reducer.pop_stats().as_dict("comm/"))
        self.metrics.flush_if_due(self.lightning_module)

    def _close_reducer(self) -> None:
        stopped = self._reducer.close() if self._reducer is not None else True
        self._reducer = None
        if self._ring_group is not None and stopped and dist.is_initialized():
            dist.destroy_process_group(self._ring_group)
        self._ring_group = None

    @override
    def teardown(self) -> None:
        log.debug(f"{self.__class__.__name__}: closing the ring reducer")
        self._close_reducer()
        super().teardown()
