"""``TensorParallelStrategy`` ("tensor"): wide linear layers split inside the layer, x data parallel.

Megatron-style (Shoeybi et al. 2019), by :mod:`lightning_strategies.comm.tensor`; ``world = replicas x tp_size``
on a ``("dp", "tp")`` mesh. The hooks changed (the rest is ``DDPStrategy``'s):

- ``_configure_launcher`` / ``setup_environment`` (``ModelParallelStrategy``'s): ``tp_size`` checked early; the mesh.
- ``configure_ddp``: no DDP wrapper; rank 0's weights everywhere, then the plan checked and the layers split
  (the optimizer is built afterwards, over the shards).
- ``backward``: the gradients averaged (one flattened all-reduce per kind) before ``on_after_backward``;
  ``block_backward_sync`` skips that on micro-steps that only accumulate.
- ``optimizer_step``: logs ``comm/*`` and ``tensor/allreduce_time_share``.
- ``lightning_module_state_dict`` / ``optimizer_state`` / ``load_*``: full tensors in the file, shards in memory.
- ``on_train_end`` / ``teardown``: the full optimizer state kept for after fit; the module given back whole.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.comm.pipeline import average_gradients
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.comm.tensor import (
    STYLES,
    TensorParallelModule,
    auto_plan,
    check_plan,
    full_tensor,
    is_sharded,
    local_part,
    parallelize,
    ring_all_reduce_bytes,
    shard_full_tensor,
)
from lightning_strategies.optim import Lamb, Lars
from lightning_strategies.strategies._base import exposed, optimizer_state_unsplit, unwrap_optimizer
from lightning_strategies.strategies._model_parallel import (
    GroupNormPrecision,
    ModelParallelStrategy,
    destroy_at_exit,
    forget_at_exit,
)

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(ModelParallelStrategy):
    """Intra-layer model parallelism of ``nn.Linear`` layers, optionally x data parallelism.

    Each split layer holds ``1/tp_size`` of its weight on every rank of its tensor-parallel group, whose ranks
    see the same batches. Optimizers run on the shards; torch's, :class:`~lightning_strategies.optim.Lamb` and
    :class:`~lightning_strategies.optim.Lars` (per-tensor path) see whole-layer norms. Logged per step:
    ``comm/*`` (activation collectives and gradient averaging, bytes under the ring model ``2(n-1)/n x
    payload``), ``tensor/activation_bytes_sent`` and ``tensor/allreduce_time_share``. Checkpoints hold full
    tensors (any ``tp_size`` resumes them); after fit the module is whole on every rank. On a fault: as ``ddp``.

    Args:
        tp_size: ranks per tensor-parallel group; default the world size, which must be a multiple.
        plan: ``None`` splits every linear layer (:func:`~lightning_strategies.comm.tensor.auto_plan`: consecutive
            linear layers of an ``nn.Sequential`` become column/row pairs, a lone one is column-parallel with its
            output gathered); or module path -> ``"colwise"`` / ``"rowwise"`` / ``"colwise_gather"``, e.g.
            ``{"head.0": "colwise", "head.2": "rowwise"}`` (a ``"rowwise"`` layer takes a ``"colwise"`` one's
            output through elementwise ops only).
        **kwargs: everything else ``DDPStrategy`` takes (``timeout``, ``start_method``, ...).

    Raises:
        ValueError: for a non-positive ``tp_size`` or a malformed plan; at launch, a ``tp_size`` not dividing the
            world; at setup, a plan that does not fit the module, another precision than 32-bit, manual
            optimization, or Lamb/Lars with ``foreach=True``.
    """

    strategy_name = "tensor"
    mesh_axis = "tp"
    size_option = "tp_size"

    def __init__(self, *, tp_size: int | None = None, plan: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
            raise ValueError(
                f"TensorParallelStrategy(tp_size={tp_size!r}): expected a positive integer or None (the world "
                "size). Fix: pass e.g. tp_size=2."
            )
        if plan is not None:
            if not isinstance(plan, Mapping) or not all(isinstance(k, str) for k in plan):
                raise ValueError(
                    f"TensorParallelStrategy(plan={plan!r}): expected None or a mapping from module path to style, "
                    "e.g. {'head.0': 'colwise', 'head.2': 'rowwise'}."
                )
            bad = {k: v for k, v in plan.items() if v not in STYLES}
            if bad:
                raise ValueError(
                    f"TensorParallelStrategy(plan=...): found the style(s) {bad}: expected one of "
                    f"{', '.join(repr(s) for s in STYLES)}. Fix: use one of them per layer."
                )
        super().__init__(model_parallel_size=tp_size, **kwargs)
        self._plan = dict(plan) if plan is not None else None
        self._tp: TensorParallelModule | None = None
        self._grad_stats = CommStats()
        self._step_started: float | None = None

    @property
    def tp_size(self) -> int:
        """Ranks per tensor-parallel group: the ``tp_size`` option, or the world size."""
        return self.model_parallel_size

    tensor_parallel: TensorParallelModule | None = exposed(
        "_tp", "The split module (``None`` outside setup .. teardown)."
    )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and module is not None and not module.automatic_optimization:
            raise ValueError(
                "TensorParallelStrategy found `automatic_optimization = False`: expected automatic optimization, "
                "since the strategy averages gradients in its backward. Fix: use automatic optimization."
            )
        if type(self.precision_plugin) not in (Precision, GroupNormPrecision):
            raise ValueError(
                f"TensorParallelStrategy found the precision plugin {type(self.precision_plugin).__name__}: only "
                "32-bit precision is supported. Fix: use Trainer(precision='32-true')."
            )
        self.precision_plugin = GroupNormPrecision(
            lambda: self._group("tp"), lambda: self.root_device, is_split=is_sharded, local=local_part
        )
        super().setup(trainer)  # fitting: configure_ddp splits the layers, then the optimizers are built
        if self._tp is None:
            self._parallelize()  # validate / test / predict: the module is split too
        if fitting:
            self._check_optimizers()

    @override
    def configure_ddp(self) -> None:
        if self.model is not None and dist.is_available() and dist.is_initialized():
            _sync_module_states(self.model)  # rank 0's initial weights everywhere, as DDP does
        self._parallelize()

    def _parallelize(self) -> None:
        module = self.lightning_module
        assert module is not None and self._mesh is not None
        plan = self._plan if self._plan is not None else auto_plan(module)
        check_plan(module, plan, self.tp_size)
        self._tp = parallelize(module, self._mesh["tp"], plan)

    def _check_optimizers(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            opt = unwrap_optimizer(optimizer)
            if not isinstance(opt, Lamb | Lars):
                continue
            for g, group in enumerate(opt.param_groups):
                if group.get("foreach") is True and any(isinstance(p, DTensor) for p in group["params"]):
                    raise ValueError(
                        f"TensorParallelStrategy found {type(opt).__name__}(foreach=True) (optimizer {i}, param group "
                        f"{g}) over split layers: expected foreach=None or False, since the multi-tensor norms do "
                        "not run on sharded DTensors. Fix: pass foreach=None (it picks the per-tensor path, which "
                        "takes whole-layer norms)."
                    )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._step_started is None:
            self._step_started = time.perf_counter()  # the first micro-step of this optimizer step
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Strategy.backward, averaging before post_backward: on_after_backward sees averaged gradients, as under DDP
        module = self._module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._average_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _average_gradients(self) -> None:
        """Sharded gradients averaged across replicas, the others across the whole mesh (a replicated gradient is
        the same on every rank of a group, so this equals the replicas' average and keeps every copy identical)."""
        module = self.lightning_module
        if module is None or self._mesh is None or not self._sync_replicas or self.world_size == 1:
            return
        sharded: list[Tensor] = []
        replicated: list[Tensor] = []
        for p in module.parameters():
            if p.grad is not None:
                (sharded if is_sharded(p) else replicated).append(local_part(p.grad))
        for grads, group, size in ((sharded, self._group("dp"), self.replicas), (replicated, None, self.world_size)):
            if not grads or size == 1:
                continue
            t0 = time.perf_counter()
            with torch.no_grad():
                sent = ring_all_reduce_bytes(average_gradients(grads, group), size)
            self._grad_stats += CommStats(sent, sent, 1, time.perf_counter() - t0)

    @override
    def _after_optimizer_step(self) -> None:
        started, self._step_started = self._step_started, None
        if self._tp is None or started is None:
            return
        wall = time.perf_counter() - started
        act = self._tp.stats.pop()
        grads = self._grad_stats.reset()
        self.metrics.add(
            **(act + grads).as_dict("comm/"),
            **{
                "tensor/activation_bytes_sent": float(act.bytes_sent),
                "tensor/allreduce_time_share": act.seconds / wall if wall > 0 else 0.0,
            },
        )
        self.metrics.flush_if_due(self.lightning_module)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model on global rank 0 (``{}`` elsewhere), each shard gathered to group rank 0 alone."""
        module = self._module
        state = module.state_dict()
        if self._tp is None:
            return state
        if self._replica_rank() != 0:
            return {}
        out = {key: _gathered(value) for key, value in state.items()}  # the gathers: every rank, in key order
        return {key: v for key, v in out.items() if v is not None} if self.global_rank == 0 else {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state on rank 0, indexed as over the unsplit module (after fit: kept at its end)."""
        opt = unwrap_optimizer(optimizer)
        if self._tp is None:
            return optimizer_state_unsplit(self, opt)
        if self._replica_rank() != 0:
            return {}
        state = opt.state_dict()
        gathered = {index: {key: _gathered(v) for key, v in entry.items()} for index, entry in state["state"].items()}
        if self.global_rank != 0:
            return {}
        return {"state": gathered, "param_groups": state["param_groups"]}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Full tensors from the file: each rank cuts its shard from them (no communication).
        module = self._module
        state = dict(checkpoint["state_dict"])
        for key, current in module.state_dict().items():
            value = state.get(key)
            if isinstance(current, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
                state[key] = shard_full_tensor(value, current)
        module.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for optimizer in self.optimizers:
            opt = unwrap_optimizer(optimizer)
            for p, entry in opt.state.items():
                if not isinstance(p, DTensor):
                    continue
                for key, value in entry.items():
                    if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == p.shape:
                        entry[key] = shard_full_tensor(value, p)

    @override
    def teardown(self) -> None:
        """Give the module back whole (on every rank); keep the mesh for a later ``test()``: DTensor caches sharding
        decisions keyed by meshes equal by layout, so a new mesh after this one's groups died would meet cached
        specs naming dead groups. The groups go at interpreter exit; after an error nothing waits for peers."""
        tp, self._tp = self._tp, None
        if tp is not None and not self.failed:
            tp.unparallelize()
        if self.failed:
            forget_at_exit(self._own_groups())
            self._mesh = None  # its peers may be gone: a later stage builds a new one
        self._grad_stats.reset()
        self._step_started = None
        super().teardown()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_at_exit(self._own_groups())


def _gathered(value: Any) -> Any:
    """``value`` whole on its group's rank 0 (``None`` elsewhere when split), a split one on the CPU; a
    collective over the value's mesh for a ``DTensor``, plain values as they are."""
    full = full_tensor(value, dst=0)
    return full.detach().cpu() if isinstance(value, DTensor) and full is not None else full
