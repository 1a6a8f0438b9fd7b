"""The hooks that connect :class:`~lightning_strategies.comm.ps.buckets.OverlappedPush` to a model (one
post-accumulate-grad hook per trainable tensor, one forward pre-hook per module holding any), and the
strategy hooks that wait for every value in flight before anything else reads the weights."""

from __future__ import annotations

import functools
import logging
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_strategies.comm.ps import ParameterServerClient
from lightning_strategies.comm.ps.bucket_replies import BucketwisePush
from lightning_strategies.comm.ps.buckets import DEFAULT_FIRST_BUCKET_MB, OverlappedPush, bucket_caps, bucket_groups
from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient
from lightning_strategies.comm.ps.hierarchy_overlap import HierarchicalOverlappedPush
from lightning_strategies.comm.ps.plan import Slice, partition_per_group
from lightning_strategies.comm.ps.spec import OptimizerSpec
from lightning_strategies.strategies._base import is_last_batch

__all__ = ["OverlapHooks", "PushOverlapMixin", "partition_per_bucket", "plan_reply_per_bucket"]

log = logging.getLogger(__name__)


def partition_per_bucket(params: Sequence[Tensor], num_servers: int, *, bucket_cap_mb: float) -> list[list[Slice]]:
    """The shard plan of ``reply_per_bucket``: each of the overlapped push's buckets (as :class:`OverlapHooks` makes
    them) split evenly over the shards, so every shard completes a bucket when the others do."""
    nbytes = [p.numel() * p.element_size() for p in params]
    groups = bucket_groups(nbytes, **bucket_caps(bucket_cap_mb, _first_bucket_mb(bucket_cap_mb)))
    return partition_per_group([p.numel() for p in params], groups, num_servers)


def _first_bucket_mb(bucket_cap_mb: float) -> float:
    return min(DEFAULT_FIRST_BUCKET_MB, bucket_cap_mb)  # a smaller cap: every bucket that size


def plan_reply_per_bucket(
    strategy: str,
    reply_per_bucket: bool | None,
    *,
    overlap: bool,
    flat: bool,
    spec: OptimizerSpec,
    clipping: bool,
    num_nodes: int,
) -> bool:
    """Whether the shards step and answer each bucket on its own (``reply_per_part`` of
    :class:`~lightning_strategies.comm.ps.ParameterShard`), each bucket split over every shard. It needs the
    overlapped push's buckets, a flat push (a hierarchical push lands its values through the node's all-gather
    of whole shards), an optimizer of :attr:`OptimizerSpec.elementwise` and no clipping (a global norm needs
    every slice). ``None`` turns it on where that holds and the push crosses nodes (``num_nodes > 1``): on one
    node the extra slices and replies cost CPU that the loopback does not pay back (measured,
    docs/measured/cluster.md).

    Raises:
        ValueError: under ``True``, naming what rules it out.
    """
    if reply_per_bucket is False or (reply_per_bucket is None and num_nodes < 2):
        return False
    blocked = [
        *([] if overlap else ["no overlapped push (overlap=False, or 16-mixed: one push after the backward)"]),
        *([] if flat else ["the hierarchical push (a node's values are all-gathered whole)"]),
        *([] if spec.elementwise else [f"{spec.optimizer_class.__qualname__}, which is not elementwise"]),
        *(["clipping (its global norm needs every gradient)"] if clipping else []),
    ]
    if blocked and reply_per_bucket:
        raise ValueError(
            f"{strategy}(reply_per_bucket=True) found {'; '.join(blocked)}: expected the overlapped, flat push of "
            "an elementwise optimizer (torch.optim's SGD, Adam, AdamW, ...) without clipping, because each shard "
            "then steps part of its tensors at a time. Fix: pass reply_per_bucket=None (per bucket where it "
            "applies) or False."
        )
    return not blocked


class OverlapHooks:
    """Pushes during backward and pulls before each module's forward, for one client and model.

    A tensor held directly by ``root`` (the LightningModule, whose ``forward`` a ``training_step`` need not
    call) or by no module is waited for in :meth:`before_training_step` instead of a pre-hook.

    Args:
        client: the worker's client (its ``params`` in the optimizer's flat order); a hierarchical one's
            buckets are reduced in its node first (:class:`HierarchicalOverlappedPush`).
        optimizer: the worker's optimizer, whose current learning rates travel with each push.
        root: the model.
        bucket_cap_mb: as ``DDPStrategy``'s.
        replies_per_bucket: the shards answer each bucket on its own: its values land per bucket
            (:class:`BucketwisePush`).
    """

    def __init__(
        self,
        client: ParameterServerClient,
        optimizer: Optimizer,
        root: Module,
        *,
        bucket_cap_mb: float,
        replies_per_bucket: bool = False,
    ) -> None:
        hierarchical = isinstance(client, HierarchicalParameterServerClient)  # reduced in the node first
        kind: type[OverlappedPush] = (
            HierarchicalOverlappedPush if hierarchical else BucketwisePush if replies_per_bucket else OverlappedPush
        )
        self.push = kind(
            client,
            lambda: [float(g["lr"]) for g in optimizer.param_groups],
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=_first_bucket_mb(bucket_cap_mb),
        )
        index = {id(p): i for i, p in enumerate(client.params)}
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
            for i, p in enumerate(client.params)
            if p.requires_grad  # a frozen tensor in the optimizer: its bucket goes at the step, with None
        ]
        held: set[int] = set()
        for module in root.modules():
            if module is root:
                continue
            # every module holding a tensor waits for it (a tied weight: each of its holders)
            mine = sorted({index[id(p)] for p in module.parameters(recurse=False) if id(p) in index})
            if mine:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._before_forward, mine)))
                held.update(mine)
        self.eager = [i for i in range(len(client.params)) if i not in held]

    def _grad_ready(self, index: int, _param: Tensor) -> None:
        self.push.grad_ready(index)

    def _before_forward(self, tensors: Sequence[int], _module: Module, _args: Any) -> None:
        self.push.wait_for(tensors)

    def before_training_step(self) -> None:
        """Land the values of the tensors no pre-hook waits for (the root's own)."""
        self.push.wait_for(self.eager)

    def remove(self) -> None:
        """Remove every hook (teardown)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class PushOverlapMixin(DDPStrategy):
    """The strategy side of ``overlap``: every value in flight lands before evaluation, a state dict and on
    request; accumulating micro-batches push nothing. Set ``_overlap`` when fitting with ``overlap``."""

    _overlap: OverlapHooks | None = None
    _replies_per_bucket = False  # decided at setup (_plan_replies)
    # set by the strategy: its options, whether overlap applies to the class, and the setup's decisions
    _overlap_option: bool
    _reply_per_bucket: bool | None
    _bucket_cap_mb: float
    overlap_supported: ClassVar[bool]

    @property
    def replies_per_bucket(self) -> bool:
        """Whether this fit's shards step and answer each bucket on its own (``False`` outside of fitting;
        ``reply_per_bucket`` decides)."""
        return self._replies_per_bucket

    def _overlaps(self) -> bool:
        """Whether this fit pushes during backward: ``overlap``, but not under ``16-mixed`` (the scaler checks the
        whole backward's gradients for an overflow before any may leave)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return self._overlap_option and self.overlap_supported and not isinstance(scaler, torch.amp.GradScaler)

    def _plan_replies(
        self, spec: OptimizerSpec, params: Sequence[Tensor], plan: list[list[Slice]], *, flat: bool, clipping: bool
    ) -> list[list[Slice]]:
        """Decide ``reply_per_bucket`` (:func:`plan_reply_per_bucket`); the shard plan to use: ``plan``, or under
        replies per bucket every bucket split over every shard (they complete it together)."""
        self._replies_per_bucket = plan_reply_per_bucket(
            type(self).__name__, self._reply_per_bucket, overlap=self._overlaps(), flat=flat, spec=spec,
            clipping=clipping, num_nodes=self.num_nodes,
        )  # fmt: skip
        if not self._replies_per_bucket:
            return plan
        return partition_per_bucket(params, len(plan), bucket_cap_mb=self._bucket_cap_mb)

    @property
    def overlap(self) -> OverlapHooks | None:
        """The overlapped push and pull in effect (its ``push.timeline`` holds each step's timestamps)."""
        return self._overlap

    def wait_for_pulls(self) -> None:
        """Write every shard's values in flight into the parameters (a no-op without ``overlap``)."""
        if self._overlap is not None:
            self._overlap.push.settle()

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches push nothing, as DDP's ``no_sync``: the stepping one pushes the sum."""
        overlap = self._overlap
        if overlap is None:
            yield
            return
        overlap.push.enabled = False
        try:
            yield
        finally:
            overlap.push.enabled = True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_pulls()
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self.wait_for_pulls()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.wait_for_pulls()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.wait_for_pulls()
        super().on_predict_start()

    def _settle_at_epoch_end(self) -> None:
        """After the optimizer step that ends an epoch (or the fit), land its values now: the callbacks'
        ``on_train_epoch_end`` / ``on_train_end`` run before the strategy's and may read the weights, and a
        peer lost in the step is then noticed here, where the step's failure is raised in time (measured under
        the hierarchical push: landing only in the next forward, a survivor first sat out the strategy's
        ``timeout`` at the epoch's end, in 3 of 7 runs of ``test_peer_death_hier.py``'s step case)."""
        trainer = self.lightning_module.trainer if self._overlap is not None and self.lightning_module else None
        if trainer is None:
            return
        last_step = trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps  # not counted yet
        if last_step or is_last_batch(trainer):
            self.wait_for_pulls()

    def _settle_quietly(self, *, failed: bool) -> None:
        """After a failure: land the last step's values if all have arrived (an on-exception checkpoint
        saves them), without waiting, since a lost peer may hold some up for the whole timeout; else keep
        the previous step's everywhere. On a clean teardown: wait for them."""
        if self._overlap is None:
            return
        push = self._overlap.push
        if failed or push.pushing:
            if not push.settle_if_arrived():
                log.warning(
                    f"{type(self).__name__}: the last step's values had not all arrived: kept the step's before"
                )
            return
        push.settle()

    def _remove_overlap(self) -> None:
        if self._overlap is not None:
            self._settle_quietly(failed=getattr(self, "failed", False))
            self._overlap.remove()
            self._overlap = None
