"""``PipelineStrategy`` ("pipeline"): the model split into stages, micro-batches streamed through them.

Model parallelism by pipelining (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019 / 2021):
the module's :meth:`~lightning_strategies.PipelineModule.pipeline_layers` are cut into
``num_stages`` contiguous stages, one per process, and each batch is cut into ``microbatches``
that flow through them, so stage ``k`` works on micro-batch ``i`` while stage ``k+1`` works on
``i-1``. Schedules, stages and point-to-point transfers are ``torch.distributed.pipelining``'s;
this file is the glue to Lightning. With ``world = replicas x num_stages`` processes, each
stage is replicated and its gradients are averaged across replicas (a ``("dp", "pp")``
device mesh).

The hooks changed (everything else, launching included, is ``DDPStrategy``'s):

- ``connect``: the module must implement :class:`~lightning_strategies.PipelineModule`.
- ``_configure_launcher`` / ``setup_environment`` (``ModelParallelStrategy``'s, with the
  schedule's checks added): the options checked against the world size before any process
  starts; the ``("dp", "pp")`` mesh.
- ``setup``: the precision plugin (global-norm clipping; autocast in the stages and one loss
  scale under mixed precision); with ``Trainer(sync_batchnorm=True)``, batch norm synced over a
  stage's replicas; the blocks, for every trainer function.
- ``configure_ddp``: no DDP wrapper (each stage's replicas average its gradients in ``backward``);
  rank 0's weights everywhere.
- ``training_step``: the schedule's ``step()`` (forward + backward of every micro-batch, one
  forward per step as on a single device); the last stage's outputs of that forward go to every
  rank, and the module's own ``training_step`` runs on them, so its ``self.log`` and metrics
  see what a single device would. Lightning's closure is training_step -> zero_grad ->
  backward, so the gradients the step made are set aside until ``backward``.
- ``backward``: adds the set-aside gradients into ``.grad`` (accumulating, as a backward
  does), then averages them over replicas.
- ``validation_step`` / ``test_step`` / ``predict_step``: the schedule's eval mode.
- ``block_backward_sync`` (``ModelParallelStrategy``'s): micro-steps that only accumulate skip
  the replicas' averaging.
- ``_after_optimizer_step``: logs ``pipeline/bubble_fraction`` and ``pipeline/stage_seconds/<k>``.
- ``lightning_module_state_dict`` / ``optimizer_state`` / ``load_optimizer_state_dict``: the
  full model and the full optimizer state gathered from the stages (a single-device model of
  the same class loads them); resuming re-splits them. ``on_train_end`` gathers the model too,
  so every rank (and the caller of a fork-launched fit) ends with the trained weights.
- ``teardown``: destroys the process groups the strategy made.
- ``process_dataloader``: ``drop_last`` for training, and the batch checked against the
  micro-batches before the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import override

from lightning_strategies.comm.pipeline import (
    SCHEDULES,
    LossFn,
    PipelineRuntime,
    average_gradients,
    partition_blocks,
    profile_blocks,
)
from lightning_strategies.pipeline_protocol import check_pipeline_module
from lightning_strategies.strategies._base import log_due, log_values, unwrap_optimizer
from lightning_strategies.strategies._model_parallel import GroupNormPrecision, ModelParallelStrategy
from lightning_strategies.strategies._pipeline_plugins import PipelineMixedPrecision, StageSyncBatchNorm

__all__ = ["BALANCES", "PipelineStrategy"]

BALANCES: tuple[str, ...] = ("params", "time")

Balance = str | Sequence[int]


class PipelineStrategy(ModelParallelStrategy):
    """Pipeline model parallelism (GPipe, 1F1B or interleaved 1F1B), optionally x data parallelism.

    Registered as ``"pipeline"`` on ``import lightning_strategies``. The module must implement
    :class:`~lightning_strategies.PipelineModule`, and batches must be ``(inputs, targets)``
    pairs of tensors split along dim 0. Every stage of a replica sees the same batches (the
    sampler shards over replicas only, ``drop_last`` is enforced for training), and the
    scaling rule sees the replicas (``distributed_sampler_kwargs["num_replicas"]``).

    ``training_step`` runs the schedule's ``step()`` and then the module's own step on the last
    stage's outputs of that forward: logging sees exactly the single-device values, and dropout
    and batch-norm statistics see one forward per step, as on a single device. The module's
    loss has no graph: it reaches ``on_before_backward`` / ``on_after_backward`` only, and
    ``backward`` adds the gradients the step made. The pipeline runs on the
    batch's inputs as the dataloader delivers them, so ``training_step`` must call ``self(x)``
    on them unchanged (augment in the dataset or ``on_after_batch_transfer``). Batch norm works
    per micro-batch (as under GPipe), so a model with batch norm trains like a model with a
    smaller batch for its statistics; without batch norm the result equals the unsplit model.

    ``Trainer(sync_batchnorm=True)`` syncs each batch-norm layer's statistics over the replicas of
    its stage (the ranks that run it), on CUDA; with one replica there is nothing to sync (it says
    so and trains with plain batch norm). Torch's ``SyncBatchNorm`` runs on GPUs only, so on CPU
    it is refused at setup.

    Logged every step that Lightning logs: ``pipeline/bubble_fraction`` (mean over stages of
    the share of a step's wall time a stage was not computing) and ``pipeline/stage_seconds/<k>``
    (compute seconds of stage ``k`` per step), means over the steps since the last log. On CUDA
    every chunk and step is timed with CUDA events on the compute stream, read once per logging
    step (no host synchronisation per chunk or step); on CPU with the host clock.

    Precision: ``32-true``, ``bf16-mixed`` and ``16-mixed``. Under mixed precision each stage's
    forward chunks and the loss run under the plugin's autocast and the backward chunks outside
    it, as on one device (activations cross stages in the autocast dtype). Under ``16-mixed`` the
    last stage scales the loss, and the overflow verdict is agreed over the world after unscaling:
    an inf or nan on any stage of any replica skips the step on every rank, and every rank's loss
    scale moves alike (:class:`~lightning_strategies.strategies._pipeline_plugins.PipelineMixedPrecision`).

    On a fault: a stage that dies closes its connections, so the stages exchanging micro-batches
    with it fail at once, and the others at their next transfer or collective; a hung stage
    fails them after ``timeout``. The survivors' errors name the lost rank(s) from their
    heartbeats (``"pipeline: lost peer rank 1 of 4: ..."``, :mod:`lightning_strategies.faults`; a
    :class:`~lightning_strategies.PeerLostError` when a step failed, else a note on the error).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"`` (any case). 1F1B keeps at
            most ``num_stages`` micro-batches of activations instead of all of them.
        microbatches: micro-batches per batch; default ``4 x num_stages``. Fewer than the stages
            leaves most stages idle (a warning); each replica's batch must divide evenly.
        num_stages: pipeline ranks; default the world size. The world size must be a multiple
            (``replicas = world / num_stages``).
        balance: how blocks are assigned to stages: ``"params"`` (equal parameter counts),
            ``"time"`` (forward + backward of each block timed on the first micro-batch, the
            slowest stage made as fast as possible), or the list of block counts per stage.
        stages_per_rank: stages each rank holds under ``"interleaved_1f1b"`` (default 2;
            must be 1 for the other schedules).
        **kwargs: ``timeout`` (how long collectives and transfers, the mesh's groups too, wait
            for a slow or hung peer; default 30 minutes, as DDP), ``process_group_backend``
            (``"gloo"`` / ``"nccl"``; default by device) and ``start_method`` (``"popen"``
            re-runs the script, for torchrun and SLURM; ``"spawn"``, ``"fork"`` (fast on CPU) or
            ``"forkserver"``), as for ``DDPStrategy``, and the plugins the Trainer sets.

    Raises:
        ValueError: for an unknown schedule or balance (the valid ones listed), or a
            non-positive count; at setup, for ``Trainer(sync_batchnorm=True)`` on CPU, or a
            precision other than ``32-true``, ``bf16-mixed``, ``16-mixed``.
        TypeError: for DDP-wrapper options (``find_unused_parameters``, ...): there is no wrapper.
    """

    strategy_name = "pipeline"
    mesh_axis = "pp"
    size_option = "num_stages"

    def __init__(
        self,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        num_stages: int | None = None,
        balance: Balance = "params",
        stages_per_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_parallel_size=num_stages, **kwargs)
        name = str(schedule).lower()
        if name not in SCHEDULES:
            raise ValueError(
                f"PipelineStrategy(schedule={schedule!r}): unknown schedule; expected one of "
                f"{', '.join(repr(s) for s in SCHEDULES)} (any case). Fix: pass one of them."
            )
        for option, value in (("microbatches", microbatches), ("num_stages", num_stages)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"PipelineStrategy({option}={value!r}): expected a positive integer or None (the default)."
                )
        interleaved = name == "interleaved_1f1b"
        if stages_per_rank is None:
            stages_per_rank = 2 if interleaved else 1
        if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
            raise ValueError(f"PipelineStrategy(stages_per_rank={stages_per_rank!r}): expected a positive integer.")
        if stages_per_rank > 1 and not interleaved:
            raise ValueError(
                f"PipelineStrategy(schedule={schedule!r}, stages_per_rank={stages_per_rank}): only "
                "'interleaved_1f1b' runs several stages per rank. Fix: pass schedule='interleaved_1f1b', "
                "or stages_per_rank=1."
            )
        self._balance = _check_balance(balance)
        self._schedule = name
        self._microbatches = microbatches
        self._stages_per_rank = stages_per_rank
        self._blocks: nn.Sequential | None = None
        self._runtime: PipelineRuntime | None = None
        self._step_grads: list[Tensor | None] | None = None

    # -- options in effect -------------------------------------------------------------------

    @property
    def schedule(self) -> str:
        """The schedule's lower-case name."""
        return self._schedule

    @property
    def num_stages(self) -> int:
        """Pipeline ranks: the ``num_stages`` option, or the world size."""
        return self.model_parallel_size

    @property
    def stages_per_rank(self) -> int:
        return self._stages_per_rank

    @property
    def microbatches(self) -> int:
        """Micro-batches per batch: the option, or ``4 x num_stages``."""
        return self._microbatches if self._microbatches is not None else 4 * self.num_stages

    @property
    def runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline (``None`` until the first batch)."""
        return self._runtime

    # -- checks before anything starts -------------------------------------------------------

    @override
    def connect(self, model: pl.LightningModule) -> None:
        check_pipeline_module(model)
        super().connect(model)

    @override
    def _check_world(self) -> None:
        super()._check_world()
        stages = self.num_stages
        total = stages * self._stages_per_rank
        m = self.microbatches
        if self._schedule == "1f1b" and m < stages:
            raise ValueError(
                f"PipelineStrategy(schedule='1f1b', microbatches={m}) with {stages} stages: 1F1B needs at "
                f"least as many micro-batches as stages. Fix: pass microbatches >= {stages}, or schedule='gpipe'."
            )
        if self._schedule == "interleaved_1f1b":
            rounds = max(1, m // stages)
            if m % rounds:
                raise ValueError(
                    f"PipelineStrategy(schedule='interleaved_1f1b', microbatches={m}) with {stages} pipeline "
                    f"ranks: the micro-batches must be a multiple of the rounds max(1, {m} // {stages}) = "
                    f"{rounds}. Fix: pass microbatches a multiple of {stages}."
                )
        if m < total:
            rank_zero_warn(
                f"PipelineStrategy: {m} micro-batches for {total} stages: each stage idles for at least "
                f"{total - 1} of every {m + total - 1} slots of a step. Pass microbatches >= {total} "
                f"(4 x stages is a good start) for a smaller bubble.",
                category=UserWarning,
            )

    # -- environment and setup -----------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.precision_plugin = self._pipeline_precision(self.precision_plugin)
        self._configure_sync_batchnorm()
        super().setup(trainer)  # DDP's, with configure_ddp below
        module = self.lightning_module
        assert module is not None
        # for every trainer function: evaluation runs the stages too
        self._blocks = self._layers(module)
        self._check_blocks(len(self._blocks))

    def _pipeline_precision(self, plugin: Precision) -> Precision:
        """The Trainer's precision as a plugin that knows the pipeline (group-norm clipping, one loss scale)."""
        group, device = (lambda: self._group("pp")), (lambda: self.root_device)
        if isinstance(plugin, PipelineMixedPrecision) or type(plugin) is GroupNormPrecision:
            return plugin
        if type(plugin) is MixedPrecision:
            mixed = cast(Literal["16-mixed", "bf16-mixed"], plugin.precision)
            return PipelineMixedPrecision(mixed, plugin.device, plugin.scaler, group=group, root_device=device)
        if type(plugin) is Precision:
            return GroupNormPrecision(group, device)
        raise ValueError(
            f"PipelineStrategy found the precision plugin {type(plugin).__name__}: expected 32-true, bf16-mixed or "
            "16-mixed (the schedule runs each stage's forward under the plugin's autocast and its backward "
            "itself). Fix: use Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed')."
        )

    def _configure_sync_batchnorm(self) -> None:
        # Lightning's plugin would sync every batch norm over the world; a stage's layers run on
        # its replicas only, so they sync over the stage's data-parallel group.
        layer_sync = self._layer_sync
        if layer_sync is None or isinstance(layer_sync, StageSyncBatchNorm):
            return
        if self.root_device.type != "cuda":
            raise ValueError(
                f"PipelineStrategy found Trainer(sync_batchnorm=True) on {self.root_device.type.upper()}: "
                "expected CUDA devices, since torch's SyncBatchNorm runs on GPUs only. Fix: drop "
                "sync_batchnorm=True (each replica of a stage then normalises with its own micro-batch "
                "statistics), or train on GPUs."
            )
        if self.replicas == 1:
            rank_zero_info(
                "PipelineStrategy: sync_batchnorm=True syncs a stage's batch norm over its replicas, and "
                "this run has one: plain batch norm is used."
            )
            self._layer_sync = None
            return
        self._layer_sync = StageSyncBatchNorm(lambda: self._group("dp"))

    @override
    def configure_ddp(self) -> None:
        # Called by DDP's setup when fitting, in place of wrapping the model in DDP.
        module = self.lightning_module
        assert module is not None and self.model is not None
        if not module.automatic_optimization:
            raise ValueError(
                "PipelineStrategy found `automatic_optimization = False`: expected automatic optimization, "
                "since the pipeline schedule runs Lightning's backward for you. Fix: use automatic "
                "optimization, or strategy='ddp' for manual optimization."
            )
        _sync_module_states(self.model)  # rank 0's initial weights everywhere, as DDP's constructor does

    @staticmethod
    def _layers(module: Any) -> nn.Sequential:
        check_pipeline_module(module)
        blocks = module.pipeline_layers()
        if not isinstance(blocks, nn.Sequential):
            raise TypeError(
                f"{type(module).__name__}.pipeline_layers() returned a {type(blocks).__name__}: expected a "
                "torch.nn.Sequential of blocks. Fix: return nn.Sequential(block_1, ..., block_n)."
            )
        return blocks

    def _check_blocks(self, n_blocks: int) -> None:
        total = self.num_stages * self._stages_per_rank
        if total > n_blocks:
            raise ValueError(
                f"PipelineStrategy: {total} stages ({self.num_stages} ranks x {self._stages_per_rank} "
                f"stages per rank) but pipeline_layers() has only {n_blocks} blocks: every stage needs at "
                f"least one. Fix: use at most {n_blocks} stages, or split the model into more blocks."
            )
        if not isinstance(self._balance, str):
            counts = list(self._balance)
            if len(counts) != total or sum(counts) != n_blocks:
                raise ValueError(
                    f"PipelineStrategy(balance={counts}): expected {total} block counts (one per stage) "
                    f"adding up to the {n_blocks} blocks of pipeline_layers(), found {len(counts)} adding "
                    f"up to {sum(counts)}. Fix: give one count per stage, or balance='params'/'time'."
                )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # drop_last for training: every step needs a batch that splits into equal micro-batches.
        trainer = self.trainer
        training = trainer is not None and trainer.training
        if training and isinstance(dataloader, DataLoader):
            batch_sampler = dataloader.batch_sampler
            if isinstance(batch_sampler, BatchSampler) and not batch_sampler.drop_last:
                batch_sampler.drop_last = True
            if dataloader.batch_size is not None:
                self._check_batch_size(dataloader.batch_size)  # before the first step, not at it
        return dataloader

    # -- building the pipeline (at the first batch) ------------------------------------------

    def _ensure_runtime(self, inputs: Tensor) -> PipelineRuntime:
        if self._runtime is not None:
            return self._runtime
        module = self.lightning_module
        pp_group = self._group("pp")
        assert module is not None and self._blocks is not None and pp_group is not None
        blocks = self._blocks
        total = self.num_stages * self._stages_per_rank
        autocast, loss_scaler = self._autocast_and_scaler()
        if isinstance(self._balance, str) and self._balance == "time":
            sample = inputs[: max(1, inputs.shape[0] // self.microbatches)]
            with autocast() if autocast is not None else nullcontext():
                measured = profile_blocks(blocks, sample)
            # on the device: an NCCL group has no CPU backend
            seconds = torch.tensor(measured, dtype=torch.float64, device=self.root_device)
            # every rank measured; all must cut the model the same way: average the measurements
            dist.all_reduce(seconds)
            counts = partition_blocks((seconds / self.world_size).tolist(), total)
        elif isinstance(self._balance, str):
            counts = partition_blocks([sum(p.numel() for p in b.parameters()) for b in blocks], total)
        else:
            counts = list(self._balance)
        rank_zero_info(f"{type(self).__name__}: blocks per stage {counts}")
        self._runtime = PipelineRuntime(
            blocks,
            counts=counts,
            schedule=self._schedule,
            microbatches=self.microbatches,
            loss_fn=cast(LossFn, module.pipeline_loss),
            group=pp_group,
            device=self.root_device,
            autocast=autocast,
            loss_scaler=loss_scaler,
        )
        self._drop_foreign_optimizer_state()
        return self._runtime

    def _autocast_and_scaler(self) -> tuple[Callable[[], Any] | None, Callable[[Tensor], Tensor] | None]:
        """The stages' autocast context and the last stage's loss scaling, from the precision plugin."""
        plugin = self.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            return None, None
        scaler = plugin.scaler
        return plugin.forward_context, (scaler.scale if scaler is not None else None)

    def _drop_foreign_optimizer_state(self) -> None:
        # A restored optimizer state covers the whole model; keep only this rank's stages' part.
        if self._runtime is not None:
            for optimizer in self.optimizers:
                self._runtime.keep_own_optimizer_state(optimizer)

    # -- steps -----------------------------------------------------------------------------------

    def _split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        if isinstance(batch, list | tuple) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            return batch[0], batch[1]
        raise TypeError(
            f"PipelineStrategy found a batch of type {type(batch).__name__}: expected an (inputs, targets) "
            "pair of tensors, since stage 0 takes the inputs and the last stage the targets. Fix: return "
            "(x, y) from the dataset / collate_fn."
        )

    def _check_batch_size(self, size: int) -> None:
        m, r = self.microbatches, self.replicas
        if size % m:
            raise ValueError(
                f"PipelineStrategy: global batch {size * r} is not divisible by {m} microbatches x {r} "
                f"replicas (each replica's batch of {size} must split into {m} equal micro-batches). Fix: "
                f"set the per-replica batch size to a multiple of {m} (global batch a multiple of {m * r}), "
                "or change microbatches."
            )

    def _last_stage_outputs(self, inputs: Tensor) -> Tensor:
        runtime = self._ensure_runtime(inputs)
        return runtime.broadcast_from_last(runtime.forward(inputs), key=("eval", *inputs.shape, inputs.dtype))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Run the schedule's ``step()`` (forward and backward of every micro-batch), then the module's step.

        The module's ``training_step`` sees the last stage's outputs of this very forward (broadcast
        to every rank), so its ``self.log`` and metrics get what a single device computes, from one
        forward per step. Lightning's closure zeroes gradients *after* ``training_step`` (on the
        first micro-step of an accumulation window), so the gradients this step made are set aside
        here, the earlier micro-steps' put back, and :meth:`backward` adds this step's in.
        """
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = self._split_batch(batch)
        self._check_batch_size(inputs.shape[0])
        runtime = self._ensure_runtime(inputs)
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        params = runtime.stage_parameters
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        # the transfers run here, also outside optimizer_step (micro-steps that only accumulate)
        with self._peer_watch():
            try:
                runtime.step(inputs, targets, loss_scale=1.0 / accumulate)
                self._step_grads = [p.grad for p in params]
            finally:
                for p, g in zip(params, earlier, strict=True):
                    p.grad = g
            outputs = runtime.broadcast_from_last(runtime.last_outputs, key=("train", *inputs.shape, inputs.dtype))
        with self.precision_plugin.train_step_context(), _forward_returns(module, outputs):
            return module.training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Add the gradients :meth:`training_step`'s ``step()`` made into ``.grad``, as a backward would.

        ``closure_loss`` (the module's loss, from outputs computed without a graph) is only passed
        to the ``on_before_backward`` / ``on_after_backward`` hooks. Replicas' gradients are then
        averaged, before Lightning's clipping and optimizer step.
        """
        module = self.lightning_module
        assert module is not None and self._runtime is not None
        if self._step_grads is None:
            raise RuntimeError(
                "PipelineStrategy.backward was called without a preceding training_step: manual backward "
                "calls are not supported; use automatic optimization."
            )
        grads, self._step_grads = self._step_grads, None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with torch.no_grad():
            for p, g in zip(self._runtime.stage_parameters, grads, strict=True):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)  # accumulation across micro-steps, as backward() accumulates
        self._average_replica_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    def _average_replica_gradients(self) -> None:
        dp_group = self._group("dp")
        if self._runtime is not None and dp_group is not None and self._sync_replicas:
            average_gradients(self._runtime.stage_parameters, dp_group)

    @override
    def _after_optimizer_step(self) -> None:
        # Per-step means over the steps since the last log. Every rank agrees on whether they are
        # due (the global step, the batches every stage sees), so the all-gather pairs up.
        # The runtime's timers (CUDA events on a GPU) are read here only, once per logging step.
        runtime = self._runtime
        due = log_due(self.trainer)
        if runtime is None or due is None:
            return
        steps, wall, busy = runtime.read_timings()
        if steps == 0:
            return
        stage_seconds, bubble_fraction = runtime.gather_timings(wall / steps, [b / steps for b in busy])
        metrics = {f"pipeline/stage_seconds/{stage}": seconds for stage, seconds in stage_seconds.items()}
        metrics["pipeline/bubble_fraction"] = bubble_fraction
        module = self.lightning_module
        assert module is not None
        log_values(module, metrics, at_epoch_end=due == "epoch_end")

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs["batch"]
        inputs = self._split_batch(batch)[0] if hook != "predict_step" or isinstance(batch, list | tuple) else batch
        outputs = self._last_stage_outputs(inputs)
        with _forward_returns(module, outputs):
            return getattr(module, hook)(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval_step("predict_step", *args, **kwargs)

    # -- checkpoints ------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model: each stage's parameters and buffers broadcast from the rank that trains it.

        Every rank holds the whole module, but only its stages' part is current; after this,
        all ranks of a pipeline hold the same, current weights (replicas already agree).
        """
        module = self.lightning_module
        assert module is not None
        self._gather_full_model()
        return module.state_dict()

    def _gather_full_model(self) -> None:
        if self._runtime is not None:
            self._runtime.gather_full_model()

    @override
    def on_train_end(self) -> None:
        # The module must hold the trained weights on every rank when fit returns (the fork
        # launcher hands rank 0's module back to the caller; a later test() starts from it).
        self._gather_full_model()
        # The runtime (which knows the stages) goes at teardown: keep the full optimizer state
        # for a Trainer.save_checkpoint after fit, which would otherwise save rank 0's stages only.
        self._keep_state_at_fit_end()
        super().on_train_end()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state (every stage's part), on global rank 0; ``{}`` elsewhere.

        Indices are those of the optimizer over the whole module, so the state also loads into a
        single-device run of the same module.
        """
        optimizer = unwrap_optimizer(optimizer)
        runtime = self._runtime
        kept = self._state_after_fit(optimizer) if runtime is None else None
        if kept is not None:
            return kept
        state = optimizer.state_dict()
        if runtime is None:
            return state
        if runtime.group_size > 1 and self.global_rank // self.num_stages != 0:
            return {}  # replicas hold the same state as replica 0, which is what is saved
        return runtime.gather_optimizer_state(state)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # The full state is loaded; once the pipeline is built, the entries of other ranks'
        # stages are dropped (_drop_foreign_optimizer_state), so any split can resume it.
        super().load_optimizer_state_dict(checkpoint)
        self._drop_foreign_optimizer_state()

    # -- shutdown ---------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """Drop the pipeline and destroy the process groups this strategy made (the mesh's, the stages').

        Lightning leaves gloo groups to interpreter exit, where groups outliving the pipeline can
        abort a worker that trained successfully ("terminate called without an active exception").
        They are ours, so they go here, after the fit's last transfer; the next
        ``setup_environment`` (a ``test()`` in the same process) makes new ones. The default group
        is Lightning's and stays. After an error they are left to the process's exit: destroying a
        group waits for its pending work, which a hung peer would never complete.
        """
        groups = self._own_groups()
        self._runtime = None
        self._step_grads = None
        self._blocks = None
        if not self.failed and dist.is_available() and dist.is_initialized():
            for group in groups:
                with suppress(ValueError):  # destroyed already (the caller tore everything down)
                    dist.destroy_process_group(group)
        self._mesh = None
        super().teardown()

    def _own_groups(self) -> list[dist.ProcessGroup]:
        """The mesh's groups of this rank, and any per-direction P2P groups the stages made."""
        candidates: list[Any] = [self._group("pp"), self._group("dp")]
        if self._runtime is not None:
            candidates += self._runtime.stage_groups()
        default = dist.GroupMember.WORLD if dist.is_available() and dist.is_initialized() else None
        groups: list[dist.ProcessGroup] = []
        for group in candidates:
            if isinstance(group, dist.ProcessGroup) and group is not default and group not in groups:
                groups.append(group)
        return groups


# -- helpers ------------------------------------------------------------------------------------


def _check_balance(balance: Any) -> Balance:
    if isinstance(balance, str):
        name = balance.lower()
        if name not in BALANCES:
            raise ValueError(
                f"PipelineStrategy(balance={balance!r}): unknown balance; expected one of "
                f"{', '.join(repr(b) for b in BALANCES)} or a list of block counts per stage."
            )
        return name
    try:
        counts = [int(c) for c in balance]
    except (TypeError, ValueError):
        counts = []
    if not counts or any(c < 1 for c in counts) or any(isinstance(c, bool) for c in balance):
        raise ValueError(
            f"PipelineStrategy(balance={balance!r}): expected 'params', 'time' or a list of positive block "
            "counts, one per stage (e.g. [3, 5])."
        )
    return counts


@contextmanager
def _forward_returns(module: nn.Module, outputs: Tensor) -> Iterator[None]:
    """Within the block, ``module(x)`` returns ``outputs`` (the pipeline's) instead of computing."""

    def forward(*args: Any, **kwargs: Any) -> Tensor:
        return outputs

    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        if had:
            module.__dict__["forward"] = previous
        else:
            del module.__dict__["forward"]
