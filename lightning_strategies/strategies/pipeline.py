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
- ``tensor_init_context``: ``configure_model`` (and ``Trainer.init_module()``) build on ``meta``.
- ``model_to_device``: the stages decided and each rank's blocks materialised on its device with
  rank 0's initial weights (:func:`~lightning_strategies.comm.pipeline_stages.distribute_blocks`);
  the other blocks stay ``meta``, so their parameters, gradients and optimizer state never exist
  on this rank.
- ``configure_ddp``: no DDP wrapper (each stage's replicas average its gradients in ``backward``).
- ``training_step``: the schedule's ``step()`` (forward + backward of every micro-batch, one
  forward per step as on a single device); the last stage's outputs of that forward go to every
  rank, and the module's own ``training_step`` runs on them, so its ``self.log`` and metrics
  see what a single device would. Lightning's closure is training_step -> zero_grad ->
  backward, so the gradients the step made are set aside until ``backward``.
- ``backward``: adds the set-aside gradients into ``.grad`` (accumulating, as a backward
  does), then averages them over replicas.
- ``validation_step`` / ``test_step`` / ``predict_step``: the schedule's eval mode; predictions
  on the last stage only; ``reduce`` (``self.log(sync_dist=True)``) over the replicas.
- ``block_backward_sync`` (``ModelParallelStrategy``'s): micro-steps that only accumulate skip
  the replicas' averaging.
- ``_after_optimizer_step``: logs ``pipeline/bubble_fraction`` and ``pipeline/stage_seconds/<k>``.
- ``lightning_module_state_dict`` / ``optimizer_state``: the full model and optimizer state on
  rank 0, streamed stage tensor by stage tensor into memory-mapped temporary files (one
  ``torch.save`` file of full tensors, which a single-device model of the same class loads).
- ``load_checkpoint`` / ``load_model_state_dict`` / ``load_optimizer_state_dict``
  (``restore_checkpoint_after_setup``): the file memory-mapped, each rank copying its stages'
  tensors only; any split resumes any checkpoint.
- ``on_train_end`` / ``teardown``: the trained model and optimizer state gathered for a
  ``save_checkpoint`` after fit (and handed to the caller of a fork- or spawn-launched fit); the
  process groups the strategy made destroyed.
- ``process_dataloader``: ``drop_last`` for training, and the batch checked against the
  micro-batches before the first step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
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
    profile_blocks_with_output,
)
from lightning_strategies.comm.pipeline_stages import (
    StageLayout,
    distribute_blocks,
    gather_optimizer_state,
    gather_state_dict,
    move_blocks,
    move_to,
    profile_stages,
    tensors_of,
)
from lightning_strategies.pipeline_protocol import check_pipeline_module
from lightning_strategies.strategies._base import log_due, log_values, unwrap_optimizer
from lightning_strategies.strategies._model_parallel import GroupNormPrecision, ModelParallelStrategy
from lightning_strategies.strategies._pipeline_plugins import PipelineMixedPrecision, StageSyncBatchNorm

__all__ = ["BALANCES", "PipelineStrategy"]

BALANCES: tuple[str, ...] = ("params", "time")

#: Where a split module records its layout (a module split once keeps its split across trainer calls).
_LAYOUT = "_pipeline_layout"

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

    Memory: each rank materialises only its own stages' blocks, on its device; the other blocks
    stay on the ``meta`` device (shape and dtype, no storage), so their parameters, gradients and
    optimizer state never exist on it (the optimizer is built over all the module's parameters
    and holds state for the materialised ones only). The initial weights are global rank 0's,
    sent block by block to each stage's owners. A module whose ``__init__`` builds the whole
    model holds it whole on every rank until setup, then drops the other stages: fine when the
    model fits one process's host memory. For a model that does not, build it in
    ``configure_model``: under this strategy it runs on ``meta`` (as does
    ``Trainer.init_module()``), and rank 0 materialises and initialises one block at a time
    (each submodule's ``reset_parameters()``, in block order, from rank 0's CPU RNG: the weights
    of an unsplit model built on CPU after the same seed) before sending it on. Build only the
    layers there: other state created in that context (a torchmetrics metric's) would be ``meta``
    too, so metrics belong in ``__init__``. After fit a rank's
    module holds its own stages only (a fork- or spawn-launched fit hands the whole trained model
    to the caller); the checkpoint holds the whole model.

    Checkpoints: one ``torch.save`` file of full tensors, the model's and the optimizer's
    indexed as over the unsplit module, so it loads with ``torch.load`` + ``load_state_dict``
    into the unsplit module on one device and resumes under any strategy or split. Rank 0
    receives each stage tensor from its owner into temporary files read back memory-mapped
    (:class:`~lightning_strategies.comm.pipeline_stages.Spill`; ``TMPDIR`` needs room for the
    checkpoint), so no rank holds the whole model and optimizer state in memory. Resuming maps the
    file and each rank copies its own stages' tensors.

    Validation, test and predict run the forward-only schedule. Each sample's output is returned
    once: ``predict_step`` returns the module's prediction on each replica's last-stage rank and
    ``None`` on the other stage ranks (whose ``trainer.predict()`` returns ``None``), as DDP
    returns each rank's share. ``validation_step`` / ``test_step`` run on every rank with the
    last stage's outputs, so every rank logs the same keys; ``self.log(..., sync_dist=True)``
    reduces over the replicas only (a sum counts each sample once), and torchmetrics metrics sync
    over them too.

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
        self._layout: StageLayout | None = None
        self._profiled = False  # balance="time": measured once per strategy
        self._runtime: PipelineRuntime | None = None
        self._step_grads: list[Tensor | None] | None = None
        self._model_at_fit_end: dict[str, Any] | None = None
        self._metric_groups: list[tuple[nn.Module, Any]] = []  # torchmetrics metrics and their own groups

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

    @property
    def layout(self) -> StageLayout | None:
        """Blocks per stage and the rank of each stage (``None`` until setup)."""
        return self._layout

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # After the split: each rank copies its own stages' tensors from the (memory-mapped) file.
        return True

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``configure_model`` and ``Trainer.init_module()`` build on ``meta`` (unless ``empty_init=False``):
        a model too large for one process is materialised block by block at setup."""
        device = torch.device("meta") if empty_init is not False else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

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
        if trainer.state.fn == TrainerFn.FITTING:
            self._model_at_fit_end = None  # a new fit: the last one's model is stale
        with _no_state_broadcast(self.lightning_module):
            super().setup(trainer)  # DDP's: model_to_device (the split), configure_ddp, the optimizers
        module = self.lightning_module
        assert module is not None
        # for every trainer function: evaluation runs the stages too (taken after sync batch norm's
        # conversion, which replaces the batch-norm modules)
        self._blocks = self._layers(module)
        self._metrics_over_replicas(module)
        self._predict_on_last_stage_only(trainer)
        plugin = self.precision_plugin
        if isinstance(plugin, PipelineMixedPrecision) and trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                plugin.check_optimizer(unwrap_optimizer(optimizer))  # at setup, not at the first step

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
        # rank 0's initial weights reached every stage's owners in model_to_device

    @override
    def model_to_device(self) -> None:
        """Decide the stages and give each rank its own blocks on its device (rank 0's weights).

        Called by DDP's setup for every trainer function, before the optimizers exist. A module
        split already (a ``test`` after ``fit`` in the same processes) keeps its split and moves
        its own tensors back to the device.
        """
        module = self.lightning_module
        pp_group = self._group("pp")
        assert module is not None and pp_group is not None
        blocks = self._layers(module)
        recorded = module.__dict__.get(_LAYOUT)
        if isinstance(recorded, StageLayout):
            if recorded.ranks != self.num_stages or recorded.num_stages != self.num_stages * self._stages_per_rank:
                raise ValueError(
                    f"PipelineStrategy found {type(module).__name__} split already over {recorded.ranks} pipeline "
                    f"ranks ({list(recorded.counts)} blocks per stage): expected {self.num_stages} ranks x "
                    f"{self._stages_per_rank} stages. Fix: load the checkpoint into a fresh module, or keep "
                    "the split it was trained with."
                )
            self._layout = recorded
            move_to(module, self.root_device)
            return
        layout = self._initial_layout(blocks)
        self._check_split(module, blocks, layout)
        distribute_blocks(blocks, layout, pp_group=pp_group, dp_group=self._group("dp"), device=self.root_device)
        move_to(module, self.root_device)  # what lies outside the blocks: every rank holds it
        self._sync_rest(module, blocks)
        module.__dict__[_LAYOUT] = self._layout = layout

    def _initial_layout(self, blocks: nn.Sequential) -> StageLayout:
        self._check_blocks(len(blocks))
        total = self.num_stages * self._stages_per_rank
        if isinstance(self._balance, str):  # "params", and "time" until its first batch is measured
            counts = partition_blocks([sum(p.numel() for p in b.parameters()) for b in blocks], total)
        else:
            counts = list(self._balance)
        rank_zero_info(f"{type(self).__name__}: blocks per stage {counts}")
        return StageLayout(tuple(counts), self.num_stages)

    @staticmethod
    def _check_split(module: nn.Module, blocks: nn.Sequential, layout: StageLayout) -> None:
        """Refuse what a split cannot hold apart: a tensor shared by blocks on different ranks, and
        tensors outside the blocks (every rank keeps those) left on ``meta``."""
        where: dict[int, int] = {}
        for i, block in enumerate(blocks):
            for t in tensors_of(block):
                j = where.setdefault(id(t), i)
                if layout.owner_of_block(j) != layout.owner_of_block(i):
                    raise ValueError(
                        f"PipelineStrategy found a tensor shared by blocks {j} and {i} of pipeline_layers(), which "
                        f"go to different ranks ({list(layout.counts)} blocks per stage): expected each parameter "
                        "in one stage, since a rank holds only its own stages. Fix: untie the weights, or pass "
                        "balance=[...] so that both blocks land in one stage."
                    )
        in_blocks = {id(t) for b in blocks for t in tensors_of(b)}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) not in in_blocks and t.is_meta:
                raise ValueError(
                    f"PipelineStrategy found {name} outside pipeline_layers() on the meta device: expected the "
                    "tensors outside the blocks to hold values, since every rank keeps them whole. Fix: build "
                    "them outside the meta context (e.g. in __init__), or move them into a block."
                )

    def _sync_rest(self, module: nn.Module, blocks: nn.Sequential) -> None:
        """Rank 0's values of the tensors outside the blocks on every rank (as DDP's constructor does)."""
        in_blocks = {id(t) for b in blocks for t in tensors_of(b)}
        rest = [t for t in tensors_of(module) if id(t) not in in_blocks]
        if self.world_size > 1:
            with torch.no_grad():
                for t in rest:
                    dist.broadcast(t, src=0)

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
        assert module is not None and self._blocks is not None and pp_group is not None and self._layout is not None
        autocast, loss_scaler = self._autocast_and_scaler()
        if self._balance == "time" and not self._profiled:
            self._balance_by_time(inputs, autocast)
        self._runtime = PipelineRuntime(
            self._blocks,
            counts=self._layout.counts,
            schedule=self._schedule,
            microbatches=self.microbatches,
            loss_fn=cast(LossFn, module.pipeline_loss),
            group=pp_group,
            device=self.root_device,
            autocast=autocast,
            loss_scaler=loss_scaler,
        )
        return self._runtime

    def _balance_by_time(self, inputs: Tensor, autocast: Callable[[], Any] | None) -> None:
        """Time every block on the first micro-batch where it lies, re-cut the stages, move the blocks.

        The blocks were split by parameters at setup; each rank times its own (the micro-batch
        flows through the stages as in a forward pass), every replica measures, and the mean
        decides one layout for all. Blocks whose rank changes move there with their optimizer
        state (a resumed one), before the first step.
        """
        module, pp_group, layout, blocks = self.lightning_module, self._group("pp"), self._layout, self._blocks
        assert module is not None and pp_group is not None and layout is not None and blocks is not None
        sample = inputs[: max(1, inputs.shape[0] // self.microbatches)]
        seconds = profile_stages(
            blocks, layout, sample, group=pp_group, device=self.root_device, profile=profile_blocks_with_output,
            autocast=autocast,
        )  # fmt: skip
        dp_group = self._group("dp")
        if dp_group is not None and self.replicas > 1:
            dist.all_reduce(seconds, group=dp_group)  # on the device: an NCCL group has no CPU backend
            seconds /= self.replicas
        counts = partition_blocks(seconds.tolist(), layout.num_stages)
        rank_zero_info(f"{type(self).__name__}: balance='time': blocks per stage {counts}")
        timed = StageLayout(tuple(counts), layout.ranks)
        if timed != layout:
            optimizers = [unwrap_optimizer(o) for o in self.optimizers]
            move_blocks(blocks, layout, timed, group=pp_group, device=self.root_device, optimizers=optimizers)
            module.__dict__[_LAYOUT] = self._layout = timed
        self._profiled = True

    def _autocast_and_scaler(self) -> tuple[Callable[[], Any] | None, Callable[[Tensor], Tensor] | None]:
        """The stages' autocast context and the last stage's loss scaling, from the precision plugin."""
        plugin = self.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            return None, None
        scaler = plugin.scaler
        return plugin.forward_context, (scaler.scale if scaler is not None else None)

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
        here, the earlier micro-steps' put back, and :meth:`backward` adds this step's in. On the
        first micro-step of a window the earlier gradients are the previous optimizer step's, which
        that zeroing discards: they are dropped before the step instead, so the step's gradients
        never share memory with the last step's.
        """
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        inputs, targets = self._split_batch(batch)
        self._check_batch_size(inputs.shape[0])
        runtime = self._ensure_runtime(inputs)
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        params = runtime.stage_parameters
        # Lightning zeroes after this step exactly when batch_idx starts a window (its closure's
        # rule), unless the module decides itself how gradients are zeroed
        own_zeroing = is_overridden("optimizer_zero_grad", module, pl.LightningModule)
        zeroed_next = batch_idx % accumulate == 0 and not own_zeroing
        earlier = [None if zeroed_next else p.grad for p in params]
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
        """The module's ``predict_step`` on the last stage's outputs, on the rank holding the last
        stage only: the other stage ranks take part in the schedule and return ``None``."""
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs["batch"]
        inputs = self._split_batch(batch)[0] if isinstance(batch, list | tuple) else batch
        outputs = self._ensure_runtime(inputs).forward(inputs)
        if outputs is None:
            return None
        with self.precision_plugin.predict_step_context(), _forward_returns(module, outputs):
            return module.predict_step(*args, **kwargs)

    def _holds_last_stage(self) -> bool:
        layout, pp_group = self._layout, self._group("pp")
        assert layout is not None and pp_group is not None
        return layout.owner(layout.num_stages - 1) == dist.get_rank(pp_group)

    def _predict_on_last_stage_only(self, trainer: pl.Trainer) -> None:
        # The other stage ranks have no predictions: their trainer.predict() returns None, not a
        # list of Nones, and Lightning's "predict returned None" warning is theirs by design.
        if trainer.state.fn != TrainerFn.PREDICTING or self._holds_last_stage():
            return
        trainer.predict_loop.return_predictions = False
        trainer.predict_loop._warning_cache.add("predict returned None if it was on purpose, ignore this warning...")

    # -- logging over replicas ------------------------------------------------------------------------

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """``self.log(..., sync_dist=True)``'s reduction: over the replicas only, by default.

        Every rank of a pipeline logs the same values (the last stage's outputs reach each of
        them), so reducing over the world would count each sample once per stage in a sum; the
        replicas are what differ. An explicit ``group`` is used as given.
        """
        if group is None and self._mesh is not None:
            group = self._group("dp")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Every rank's say (early stopping, checkpoint decisions), over the world as DDP's.
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, group=dist.group.WORLD, reduce_op="sum")
        return bool(total == self.world_size) if all else bool(total)

    def _metrics_over_replicas(self, module: nn.Module) -> None:
        # torchmetrics metrics sync their states over the world by default; a pipeline's ranks
        # update them with the same samples, so they sync over the replicas (the data they differ
        # in). The metrics' own groups come back at teardown, when the mesh's groups are destroyed.
        dp_group = self._group("dp")
        for m in module.modules():
            if type(m).__module__.startswith("torchmetrics") and hasattr(m, "process_group"):
                if all(m is not seen for seen, _ in self._metric_groups):
                    self._metric_groups.append((m, m.__dict__.get("process_group")))
                m.__dict__["process_group"] = dp_group

    def _restore_metric_groups(self) -> None:
        for m, group in self._metric_groups:
            m.__dict__["process_group"] = group
        self._metric_groups = []

    # -- checkpoints ------------------------------------------------------------------------------

    def _gathers(self) -> dist.ProcessGroup | None:
        """The pipeline group when the state must be gathered from the stages (``None``: it is all here)."""
        pp_group = self._group("pp")
        if pp_group is None or self._layout is None or dist.get_world_size(pp_group) == 1:
            return None
        return pp_group

    def _owners(self, module: nn.Module) -> dict[str, int]:
        """The pipeline rank holding each state-dict key (0 for what lies outside the blocks)."""
        assert self._layout is not None
        rank_of: dict[int, int] = {}
        for i, block in enumerate(self._layers(module)):
            for t in tensors_of(block):
                rank_of[id(t)] = self._layout.owner_of_block(i)
        return {key: rank_of.get(id(value), 0) for key, value in module.state_dict(keep_vars=True).items()}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model on global rank 0 (``{}`` on the other ranks), every tensor full.

        Replica 0's stages send their tensors to rank 0 one at a time, into temporary files read
        back memory-mapped (:func:`~lightning_strategies.comm.pipeline_stages.gather_state_dict`).
        After fit: the state gathered when training ended.
        """
        module = self.lightning_module
        assert module is not None
        if self._mesh is None and self._model_at_fit_end is not None:
            return self._model_at_fit_end
        pp_group = self._gathers()
        if pp_group is None:
            return module.state_dict()
        if self.global_rank // self.num_stages != 0:
            return {}  # replicas hold the same weights as replica 0, which is what is saved
        state = module.state_dict(keep_vars=True)
        return gather_state_dict(state, self._owners(module), group=pp_group, device=self.root_device)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state (every stage's part), on global rank 0; ``{}`` elsewhere.

        Indices are those of the optimizer over the whole module, so the state also loads into a
        single-device run of the same module. After fit: the state gathered when training ended.
        """
        optimizer = unwrap_optimizer(optimizer)
        if self._mesh is None:
            kept = self._state_after_fit(optimizer)
            return kept if kept is not None else optimizer.state_dict()
        pp_group = self._gathers()
        if pp_group is None:
            return optimizer.state_dict()
        if self.global_rank // self.num_stages != 0:
            return {}
        return gather_optimizer_state(optimizer.state_dict(), group=pp_group, device=self.root_device)

    @override
    def on_train_end(self) -> None:
        # The stages' groups go at teardown: gather the trained model and optimizer state now, for
        # a Trainer.save_checkpoint after fit and for the caller of a fork- or spawn-launched fit.
        self._model_at_fit_end = self.lightning_module_state_dict()
        self._keep_state_at_fit_end()
        super().on_train_end()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint memory-mapped when it is a local file read by torch's format: each rank
        then copies only its stages' tensors out of it, so none reads the whole model into memory.
        Other checkpoint IO (remote files, a custom plugin) loads as it always does."""
        path = os.fspath(checkpoint_path) if isinstance(checkpoint_path, str | os.PathLike) else None
        io: CheckpointIO = self.checkpoint_io
        if path is None or not os.path.isfile(path) or not isinstance(io, TorchCheckpointIO):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except Exception:  # not a zip archive, an old format: the IO's own load and its diagnosis
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy this rank's stages' tensors (and what lies outside the blocks) from the full state dict.

        Keys are checked against the whole module as ``load_state_dict(strict=True)`` would, and
        the shapes of the other stages' tensors against their placeholders.
        """
        module = self.lightning_module
        assert module is not None
        state = checkpoint["state_dict"]
        own = module.state_dict(keep_vars=True)
        placeholders = {k for k, v in own.items() if isinstance(v, Tensor) and v.is_meta}
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        reshaped = [
            f"{k}: {tuple(state[k].shape)} in the checkpoint, {tuple(own[k].shape)} here"
            for k in placeholders
            if k in state and isinstance(state[k], Tensor) and state[k].shape != own[k].shape
        ]
        if reshaped or (strict and (missing or unexpected)):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
                f"unexpected keys {unexpected[:5]}, size mismatch {reshaped[:5]}. Expected the tensors of the "
                "module this run builds. Fix: resume with the model settings the checkpoint was trained with."
            )
        module.load_state_dict({k: v for k, v in state.items() if k not in placeholders}, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The file holds every stage's state, indexed over the whole module; each rank loads the
        # entries of its materialised parameters only (any split resumes any checkpoint).
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            opt = unwrap_optimizer(optimizer)
            params = [p for group in opt.param_groups for p in group["params"]]
            state = {i: entry for i, entry in saved["state"].items() if i < len(params) and not params[i].is_meta}
            optimizer.load_state_dict({**saved, "state": state})
            _optimizer_to_device(optimizer, self.root_device)

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

        Under a fork or spawn launcher, rank 0's module takes the whole trained model gathered at
        the end of fit (memory-mapped), which Lightning hands to the calling process; elsewhere a
        rank's module keeps its own stages (the others stay ``meta``).
        """
        module = self.lightning_module
        groups = self._own_groups()
        hand_back = (
            not self.failed
            and module is not None
            and self.global_rank == 0
            and bool(self._model_at_fit_end)
            and isinstance(self.launcher, _MultiProcessingLauncher)
        )
        if hand_back:
            assert module is not None and self._model_at_fit_end is not None
            module.load_state_dict(self._model_at_fit_end, assign=True)
        self._runtime = None
        self._step_grads = None
        self._blocks = None
        self._restore_metric_groups()
        if not self.failed and dist.is_available() and dist.is_initialized():
            for group in groups:
                with suppress(ValueError):  # destroyed already (the caller tore everything down)
                    dist.destroy_process_group(group)
        self._mesh = None
        with _placeholders_stay(module):
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
def _no_state_broadcast(module: nn.Module | None) -> Iterator[None]:
    """Within the block, DDP's setup for evaluation does not broadcast rank 0's whole module state:
    the split already gave each rank rank 0's weights for its own stages, and the other stages'
    placeholders have nothing to broadcast. Lightning's broadcast skips the names in
    ``_ddp_params_and_buffers_to_ignore``; the attribute is removed again afterwards, so a later
    DDP wrapper of the same module ignores nothing."""
    if module is None:
        yield
        return
    key = "_ddp_params_and_buffers_to_ignore"
    had, previous = key in module.__dict__, module.__dict__.get(key)
    module.__dict__[key] = [*(n for n, _ in module.named_parameters()), *(n for n, _ in module.named_buffers())]
    try:
        yield
    finally:
        if had:
            module.__dict__[key] = previous
        else:
            del module.__dict__[key]


@contextmanager
def _placeholders_stay(module: nn.Module | None) -> Iterator[None]:
    """Within the block, ``module.cpu()`` (Lightning's teardown) moves the tensors with values and
    leaves the other stages' ``meta`` placeholders as they are (``meta`` cannot be copied)."""
    if module is None:
        yield
        return

    def cpu() -> nn.Module:
        return module._apply(lambda t: t if t.is_meta else t.cpu())

    module.__dict__["cpu"] = cpu
    try:
        yield
    finally:
        del module.__dict__["cpu"]


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
