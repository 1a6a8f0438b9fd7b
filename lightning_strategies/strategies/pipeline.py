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
- ``_configure_launcher``: the options are checked against the world size before any process starts.
- ``setup_environment``: the process-group mesh.
- ``setup``: no DDP wrapper; rank 0's weights everywhere; the clipping plugin (global norm).
- ``training_step``: the schedule's ``step()`` (forward + backward of every micro-batch, one
  forward per step as on a single device); the last stage's outputs of that forward go to every
  rank, and the module's own ``training_step`` runs on them, so its ``self.log`` and metrics
  see what a single device would. Lightning's closure is training_step -> zero_grad ->
  backward, so the gradients the step made are set aside until ``backward``.
- ``backward``: adds the set-aside gradients into ``.grad`` (accumulating, as a backward
  does), then averages them over replicas.
- ``validation_step`` / ``test_step`` / ``predict_step``: the schedule's eval mode.
- ``block_backward_sync``: micro-steps that only accumulate skip the replicas' averaging.
- ``optimizer_step``: logs ``pipeline/bubble_fraction`` and ``pipeline/stage_seconds/<k>``.
- ``lightning_module_state_dict`` / ``optimizer_state`` / ``load_optimizer_state_dict``: the
  full model and the full optimizer state gathered from the stages (a single-device model of
  the same class loads them); resuming re-splits them. ``on_train_end`` gathers the model too,
  so every rank (and the caller of a fork-launched fit) ends with the trained weights.
- ``process_dataloader``: ``drop_last`` for training, and the batch checked against the
  micro-batches before the first step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, Literal, cast

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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch._C._distributed_c10d import Backend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import override

from lightning_strategies.checkpoint import ATOMIC_CHECKPOINT_IO_DEFAULT
from lightning_strategies.faults import PeerFailureMixin
from lightning_strategies.pipeline_protocol import check_pipeline_module
from lightning_strategies.strategies._elastic import ElasticRestartMixin

__all__ = [
    "BALANCES",
    "SCHEDULES",
    "PipelinePrecision",
    "PipelineRuntime",
    "PipelineStrategy",
    "partition_blocks",
    "profile_blocks",
]

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
BALANCES: tuple[str, ...] = ("params", "time")

LossFn = Callable[[Tensor, Tensor], Tensor]
Balance = str | Sequence[int]


# -- partitioning ----------------------------------------------------------------------------


def partition_blocks(costs: Sequence[float], parts: int) -> list[int]:
    """Split blocks into ``parts`` contiguous groups of at least one block, minimising the largest cost.

    The slowest stage sets a pipeline's pace, so the objective is the maximum, not the spread
    (linear partition, dynamic programming in ``O(parts x n^2)``; n is a few dozen blocks).

    Args:
        costs: each block's cost (parameters, or seconds of forward + backward).
        parts: the number of stages.

    Returns:
        The number of blocks of each stage, in order.

    Raises:
        ValueError: when there are fewer blocks than parts.
    """
    n = len(costs)
    if parts < 1 or n < parts:
        raise ValueError(
            f"cannot split {n} blocks into {parts} pipeline stages: every stage needs at least one block. "
            "Fix: use fewer stages (num_stages x stages_per_rank), or split the model into more blocks "
            "in pipeline_layers()."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = math.inf
    # best[k][i]: the smallest possible largest group cost of the first i blocks in k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts: list[int] = []
    i = n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def profile_blocks(blocks: nn.Sequential, sample: Tensor, *, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each block on ``sample`` (a micro-batch), median of ``repeats``.

    Each block runs on the previous one's (detached) output, with an all-ones output gradient;
    the RNG, the buffers (batch-norm statistics) and the parameters' gradients are restored
    afterwards, so profiling leaves no trace on training.
    """
    params = [p for p in blocks.parameters()]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in blocks.buffers()]
    times: list[list[float]] = [[] for _ in blocks]
    sync = sample.device.type == "cuda"
    devices = [sample.device] if sync else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for _ in range(repeats + 1):  # the first round warms up allocators and kernels
                x = sample
                for i, block in enumerate(blocks):
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    if sync:
                        torch.cuda.synchronize(sample.device)
                    t0 = time.perf_counter()
                    out = block(inp)
                    if out.requires_grad:
                        torch.autograd.backward(out, torch.ones_like(out))
                    if sync:
                        torch.cuda.synchronize(sample.device)
                    times[i].append(time.perf_counter() - t0)
                    x = out.detach()
    finally:
        with torch.no_grad():
            for b, saved in zip(blocks.buffers(), buffers, strict=True):
                b.copy_(saved)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return [sorted(t[1:])[len(t[1:]) // 2] for t in times]


# -- the pipeline itself, without Lightning ----------------------------------------------------


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up the seconds it computes (forward and backward chunks, loss).

    Transfers happen in the schedule, outside these calls, so ``busy_seconds`` is compute only:
    the rest of a step's wall time is the stage waiting (the bubble) or communicating. The last
    stage's loss, which the schedule computes between chunks, is compute too: the runtime
    records it with :meth:`record_loss`. When ``events`` is a list, each chunk also appends
    ``(stage, kind, micro-batch, start, end)`` with kind ``"F"``, ``"B"`` or ``"L"`` (the loss)
    (``time.perf_counter()`` seconds, one clock for all processes of a machine), the timeline
    from which the benchmark separates the schedule's bubble from transfer overhead.
    """

    busy_seconds: float = 0.0
    events: list[tuple[int, str, int, float, float]] | None = None
    _awaiting_loss: int | None = None  # the micro-batch forwarded last, until its loss

    def record_loss(self, t0: float) -> None:
        """Count the loss of the micro-batch forwarded last, computed since ``t0``, as compute.

        A loss with no forward chunk before it (the schedule's shape inference on the first
        step, whose forward is not a chunk either) is not counted.
        """
        if self._awaiting_loss is not None:
            self._record("L", self._awaiting_loss, t0)
            self._awaiting_loss = None

    def _sync(self) -> None:
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record(self, kind: str, chunk: int, t0: float) -> None:
        self._sync()
        t1 = time.perf_counter()
        self.busy_seconds += t1 - t0
        if self.events is not None:
            self.events.append((self.stage_index, kind, chunk, t0, t1))

    @override
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._record("F", fwd_chunk_id, t0)
            self._awaiting_loss = fwd_chunk_id

    @override
    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self._record("B", bwd_chunk_id, t0)


class PipelineRuntime:
    """This rank's stages of a pipeline, its training schedule and its forward-only schedules.

    No Lightning here: the strategy (and the benchmark) drive it. Stage ``s`` of
    ``S = group_size x stages_per_rank`` lives on group rank ``s % group_size`` (the
    interleaved layout; with one stage per rank, stage ``s`` on rank ``s``).

    Args:
        blocks: the whole model as ordered blocks (shared with the LightningModule).
        counts: blocks per stage, ``S`` entries summing to ``len(blocks)``.
        schedule: a key of :data:`SCHEDULES`.
        microbatches: micro-batches per batch.
        loss_fn: the mean loss of a micro-batch, ``loss_fn(outputs, targets)``.
        group: the pipeline's process group (this replica's stages).
        device: where this rank's stages run.
    """

    def __init__(
        self,
        blocks: nn.Sequential,
        *,
        counts: Sequence[int],
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.num_stages = len(counts)
        if self.num_stages % self.group_size:
            raise ValueError(f"{self.num_stages} stages do not spread evenly over {self.group_size} ranks")
        if sum(counts) != len(blocks):
            raise ValueError(f"stage block counts {list(counts)} do not add up to the {len(blocks)} blocks")
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = device
        self.counts = list(counts)
        self._loss_fn = loss_fn
        self._loss_scale = 1.0
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        self.blocks = blocks
        self.bounds = bounds
        self.stage_indices = list(range(self.group_rank, self.num_stages, self.group_size))
        self.submodules = [nn.Sequential(*blocks[bounds[s] : bounds[s + 1]]) for s in self.stage_indices]
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices
        self.last_rank = (self.num_stages - 1) % self.group_size
        self.train_stages = self._make_stages()
        self.train_schedule = self._make_schedule(self.train_stages, loss=True)
        # Forward-only schedules with stages of their own, one per (padded) batch size: a stage
        # infers its buffers' shapes from its first batch, and switching one schedule between
        # train and eval mode would redo that inference (a forward pass) at every switch.
        self._eval: dict[int, tuple[Any, list[_TimedStage]]] = {}
        self.last_step_seconds = 0.0
        self.last_outputs: Tensor | None = None

    @property
    def stage_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of all its stages), the ones it computes gradients for."""
        return [p for m in self.submodules for p in m.parameters()]

    def all_stages(self) -> list[tuple[nn.Sequential, int]]:
        """Every stage's blocks (all ranks hold the whole model) with the group rank that trains it."""
        return [
            (nn.Sequential(*self.blocks[self.bounds[s] : self.bounds[s + 1]]), s % self.group_size)
            for s in range(self.num_stages)
        ]

    def _make_stages(self) -> list[_TimedStage]:
        return [
            _TimedStage(m, s, self.num_stages, self.device, group=self.group)
            for m, s in zip(self.submodules, self.stage_indices, strict=True)
        ]

    def _scaled_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        t0 = time.perf_counter()
        loss = self._loss_fn(outputs, targets) * self._loss_scale
        # only the training schedule has a loss, on the rank that holds the last stage
        self.train_stages[-1].record_loss(t0)
        return loss

    def _make_schedule(self, stages: list[_TimedStage], *, loss: bool) -> Any:
        cls = SCHEDULES[self.schedule_name]
        loss_fn = self._scaled_loss if loss else None
        # scale_grads=False: the loss is scaled instead (1 / (microbatches x accumulation)), so
        # gradients accumulated across Lightning micro-steps are not divided again at each step.
        if cls is ScheduleInterleaved1F1B:
            return cls(list[Any](stages), self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)

    def stage_seconds(self, stages: list[_TimedStage] | None = None) -> list[float]:
        """Compute seconds of each local stage since the last :meth:`reset_timers`."""
        return [s.busy_seconds for s in (stages or self.train_stages)]

    def reset_timers(self) -> None:
        """Zero the compute and step seconds (and empty the timeline, when one is recorded)."""
        for s in self.train_stages:
            s.busy_seconds = 0.0
            if s.events is not None:
                s.events = []
        self.last_step_seconds = 0.0

    def record_events(self, on: bool = True) -> None:
        """Keep (or stop keeping) the timeline of the training chunks, read by :meth:`events`."""
        for s in self.train_stages:
            s.events = [] if on else None

    def events(self) -> list[tuple[int, str, int, float, float]]:
        """This rank's chunks since :meth:`reset_timers`, by start.

        Each is ``(stage, kind, micro-batch, start, end)``, kind ``"F"``, ``"B"`` or ``"L"`` (the loss).
        """
        return sorted((e for s in self.train_stages for e in s.events or ()), key=lambda e: e[3])

    def step(self, inputs: Tensor | None, targets: Tensor | None, *, loss_scale: float = 1.0) -> Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch's inputs (used on the rank holding stage 0).
            targets: the batch's targets (used on the rank holding the last stage).
            loss_scale: extra factor on the loss, ``1 / accumulation steps``.

        Returns:
            On the rank holding the last stage, the batch's mean loss (detached, unscaled);
            elsewhere ``None``. The last stage's outputs of this forward (detached, the
            micro-batches in order) are kept in :attr:`last_outputs` on that rank.
        """
        self._loss_scale = loss_scale / self.microbatches
        losses: list[Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.last_outputs = None
        t0 = time.perf_counter()
        out = self.train_schedule.step(*args, target=targets if self.has_last else None, losses=losses)
        self.last_step_seconds += time.perf_counter() - t0
        if not self.has_last:
            return None
        self.last_outputs = out.detach()
        return torch.stack([loss.detach() for loss in losses]).sum() / loss_scale

    def forward(self, inputs: Tensor) -> Tensor | None:
        """The last stage's outputs for ``inputs``, without gradients (the schedule's eval mode).

        A batch whose size is not a multiple of the micro-batches (the last one of an evaluation
        loader) is padded with copies of its last sample and the outputs are cut back, so no
        evaluation sample is dropped.

        Returns:
            On the rank holding the last stage, the outputs; elsewhere ``None``.
        """
        size = inputs.shape[0]
        padded = -(-size // self.microbatches) * self.microbatches
        entry = self._eval.get(padded)
        if entry is None:
            stages = self._make_stages()
            entry = self._eval[padded] = (self._make_schedule(stages, loss=False), stages)
        schedule, stages = entry
        # Lightning evaluates under inference_mode; the stages' receive buffers stay ordinary
        # tensors, so a schedule first used there also serves a later call outside of it.
        with torch.inference_mode(False), torch.no_grad():
            x = inputs.clone() if inputs.is_inference() else inputs
            if padded != size:
                x = torch.cat([x, x[-1:].expand(padded - size, *x.shape[1:])])
            out = schedule.eval(x) if self.has_first else schedule.eval()
        for s in stages:
            s.busy_seconds = 0.0
        return out[:size] if self.has_last else None

    def broadcast_from_last(self, tensor: Tensor | None) -> Tensor:
        """The last stage's tensor on every rank of the pipeline (shape and dtype travel first)."""
        if self.group_size == 1:
            assert tensor is not None
            return tensor
        meta: list[Any] = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
        src = dist.get_global_rank(self.group, self.last_rank)
        dist.broadcast_object_list(meta, src=src, group=self.group)
        shape, dtype = meta[0]
        tensor = torch.empty(shape, dtype=dtype, device=self.device) if tensor is None else tensor.contiguous()
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor


# -- clipping by the global norm ---------------------------------------------------------------


class PipelinePrecision(Precision):
    """32-bit precision whose clipping by norm uses the norm over *all* stages.

    Each rank holds the gradients of its stages only, so ``clip_grad_norm_`` over its own
    parameters would clip each stage by its own norm. Here the squared norms are summed over
    the pipeline group first (replicas hold identical, already averaged gradients).

    Args:
        group: returns the pipeline's process group (``None`` before the pipeline exists).
    """

    def __init__(self, group: Callable[[], dist.ProcessGroup | None]) -> None:
        super().__init__()
        self._group = group

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        group = self._group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        total = float(sq.sqrt())
        # torch.nn.utils.clip_grad_norm_'s rule: scale by clip / (norm + 1e-6), never up
        coef = min(1.0, float(clip_val) / (total + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)


# -- the strategy --------------------------------------------------------------------------------


class PipelineStrategy(PeerFailureMixin, ElasticRestartMixin, DDPStrategy):
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

    Logged every step that Lightning logs: ``pipeline/bubble_fraction`` (mean over stages of
    the share of a step's wall time a stage was not computing) and ``pipeline/stage_seconds/<k>``
    (compute seconds of stage ``k`` per step).

    On a fault: a stage that dies closes its connections, so the stages exchanging micro-batches
    with it fail at once, and the others at their next transfer or collective; a hung stage
    fails them after ``timeout``. The survivors' errors name the lost rank(s) from their
    heartbeats (``"pipeline: lost peer rank 1 of 4: ..."``, :mod:`lightning_strategies.faults`; a
    :class:`~lightning_strategies.PeerLostError` when a step failed, else a note on the error).

    Args:
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer; only 32-bit precision is supported.
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
        timeout: how long collectives and transfers (the mesh's groups too) wait for a slow
            or hung peer; default 30 minutes, as DDP.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device, as for DDP.
        start_method: how ranks start, as for ``DDPStrategy``: ``"popen"`` (re-runs the script;
            torchrun, SLURM), ``"spawn"``, ``"fork"`` (fast on CPU) or ``"forkserver"``.

    Raises:
        ValueError: for an unknown schedule or balance (the valid ones listed), or a
            non-positive count.
    """

    strategy_name = "pipeline"
    checkpoint_io = ATOMIC_CHECKPOINT_IO_DEFAULT  # atomic checkpoint writes unless the user gives an IO

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        num_stages: int | None = None,
        balance: Balance = "params",
        stages_per_rank: int | None = None,
        timeout: timedelta | None = default_pg_timeout,
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
        self._num_stages = num_stages
        self._stages_per_rank = stages_per_rank
        self._mesh: Any = None
        self._pp_group: dist.ProcessGroup | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._blocks: nn.Sequential | None = None
        self._runtime: PipelineRuntime | None = None
        self._state_at_fit_end: dict[int, dict[str, Any]] = {}  # id(optimizer) -> full state, after fit
        self._step_grads: list[Tensor | None] | None = None
        self._failed = False
        self._sync_replicas = True
        self._window_steps = 0
        self._window_wall = 0.0
        self._window_busy: list[float] = []

    # -- options in effect -------------------------------------------------------------------

    @property
    def schedule(self) -> str:
        """The schedule's lower-case name."""
        return self._schedule

    @property
    def num_stages(self) -> int:
        """Pipeline ranks: the ``num_stages`` option, or the world size."""
        return self._num_stages if self._num_stages is not None else max(1, self.world_size)

    @property
    def stages_per_rank(self) -> int:
        return self._stages_per_rank

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the pipeline, ``world size / num_stages``."""
        return max(1, self.world_size // self.num_stages)

    @property
    def microbatches(self) -> int:
        """Micro-batches per batch: the option, or ``4 x num_stages``."""
        return self._microbatches if self._microbatches is not None else 4 * self.num_stages

    @property
    def runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline (``None`` until the first batch)."""
        return self._runtime

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shards over replicas only: every stage of a replica must see the same batches.
        return {"num_replicas": self.replicas, "rank": self.global_rank // self.num_stages}

    # -- checks before anything starts -------------------------------------------------------

    @override
    def connect(self, model: pl.LightningModule) -> None:
        check_pipeline_module(model)
        super().connect(model)

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this in the launching process, once the world size is known: the
        # arithmetic fails here, before any process starts.
        self._check_world()
        super()._configure_launcher()

    def _check_world(self) -> None:
        world, stages = self.world_size, self.num_stages
        if world % stages:
            raise ValueError(
                f"PipelineStrategy(num_stages={stages}) with a world size of {world} processes: the world "
                f"size must be replicas x num_stages, and {world} is not a multiple of {stages}. Fix: pass "
                f"num_stages dividing {world} (e.g. {', '.join(str(d) for d in _divisors(world))}), or run "
                f"a multiple of {stages} processes (devices x num_nodes)."
            )
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
    def setup_environment(self) -> None:
        super().setup_environment()  # the world process group
        self._check_world()
        device_type = self.root_device.type
        # The mesh's groups get the strategy's timeout too (new groups default to 30 minutes).
        override = _group_options(self._get_process_group_backend(), self._timeout)
        self._mesh = init_device_mesh(
            device_type,
            (self.replicas, self.num_stages),
            mesh_dim_names=("dp", "pp"),
            backend_override={"dp": override, "pp": override} if override is not None else None,
        )
        self._pp_group = self._mesh.get_group("pp")
        self._dp_group = self._mesh.get_group("dp")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError(
                "PipelineStrategy found `automatic_optimization = False`: expected automatic optimization, "
                "since the pipeline schedule runs Lightning's backward for you. Fix: use automatic "
                "optimization, or strategy='ddp' for manual optimization."
            )
        if type(self.precision_plugin) not in (Precision, PipelinePrecision):
            raise ValueError(
                f"PipelineStrategy found the precision plugin {type(self.precision_plugin).__name__}: only "
                "32-bit precision is supported (the schedule runs backward itself, outside the plugin). "
                "Fix: use Trainer(precision='32-true')."
            )
        self.precision_plugin = PipelinePrecision(lambda: self._pp_group)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # rank 0's initial weights everywhere, as DDP's constructor does (and after a restore)
        if dist.is_available() and dist.is_initialized():
            _sync_module_states(self.model)
        self._blocks = self._layers(module)
        self._check_blocks(len(self._blocks))
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model  # no DDP wrapper: each stage's gradients are averaged by the strategy

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
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
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
        assert module is not None and self._blocks is not None and self._pp_group is not None
        blocks = self._blocks
        total = self.num_stages * self._stages_per_rank
        if isinstance(self._balance, str) and self._balance == "time":
            sample = inputs[: max(1, inputs.shape[0] // self.microbatches)]
            seconds = torch.tensor(profile_blocks(blocks, sample), dtype=torch.float64)
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
            group=self._pp_group,
            device=self.root_device,
        )
        self._drop_foreign_optimizer_state()
        return self._runtime

    def _drop_foreign_optimizer_state(self) -> None:
        # A restored optimizer state covers the whole model; keep only this rank's stages' part.
        if self._runtime is None:
            return
        own = {id(p) for p in self._runtime.stage_parameters}
        for optimizer in self.optimizers:
            for p in list(optimizer.state):
                if id(p) not in own:
                    del optimizer.state[p]

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
        return runtime.broadcast_from_last(runtime.forward(inputs))

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
        accumulate = module.trainer.accumulate_grad_batches if module._trainer is not None else 1
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
            outputs = runtime.broadcast_from_last(runtime.last_outputs)
        self._window_steps += 1
        self._window_wall += runtime.last_step_seconds
        busy = runtime.stage_seconds()
        self._window_busy = [a + b for a, b in zip(self._window_busy, busy, strict=True)] if self._window_busy else busy
        runtime.reset_timers()
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

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning wraps the micro-steps that only accumulate in this (as DDP's no_sync): their
        # gradients are averaged with the last micro-step's, once, before the optimizer step.
        self._sync_replicas = False
        try:
            yield None
        finally:
            self._sync_replicas = True

    def _average_replica_gradients(self) -> None:
        if self.replicas == 1 or self._runtime is None or not self._sync_replicas:
            return
        grads = [p.grad for p in self._runtime.stage_parameters if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self._dp_group)  # gloo has no AVG: sum, then divide
        flat /= self.replicas
        for g, avg in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(avg)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_pipeline_stats()
        return output

    def _log_pipeline_stats(self) -> None:
        # Logged from optimizer_step, where Lightning allows self.log; per-step means over the
        # steps since the last log. The all-gather runs only at Lightning's logging cadence,
        # which every rank agrees on (it depends on the global step).
        module = self.lightning_module
        runtime = self._runtime
        if module is None or module._trainer is None or runtime is None or not self._window_steps:
            return
        if not _should_update_logs(module):
            return
        n = self._window_steps
        mine = torch.tensor([self._window_wall / n, *(b / n for b in self._window_busy)], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(runtime.group_size)]
        dist.all_gather(gathered, mine, group=runtime.group)
        self._window_steps, self._window_wall, self._window_busy = 0, 0.0, []
        metrics: dict[str, float] = {}
        idle = []
        for rank, row in enumerate(gathered):
            wall, busy = float(row[0]), row[1:].tolist()
            idle.append(max(0.0, 1.0 - sum(busy) / wall) if wall > 0 else 0.0)
            for v, seconds in enumerate(busy):
                metrics[f"pipeline/stage_seconds/{rank + v * runtime.group_size}"] = seconds
        metrics["pipeline/bubble_fraction"] = sum(idle) / len(idle)
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

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
        runtime = self._runtime
        if runtime is None or runtime.group_size == 1:
            return
        with torch.no_grad():
            for stage, rank in runtime.all_stages():
                src = dist.get_global_rank(runtime.group, rank)
                for t in [*stage.parameters(), *stage.buffers()]:
                    dist.broadcast(t.data, src=src, group=runtime.group)

    @override
    def on_train_end(self) -> None:
        # The module must hold the trained weights on every rank when fit returns (the fork
        # launcher hands rank 0's module back to the caller; a later test() starts from it).
        self._gather_full_model()
        # The runtime (which knows the stages) goes at teardown: keep the full optimizer state
        # for a Trainer.save_checkpoint after fit, which would otherwise save rank 0's stages only.
        self._state_at_fit_end = {id(o): self.optimizer_state(o) for o in self.optimizers}
        super().on_train_end()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state (every stage's part), on global rank 0; ``{}`` elsewhere.

        Indices are those of the optimizer over the whole module, so the state also loads into a
        single-device run of the same module.
        """
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        runtime = self._runtime
        if runtime is None and id(optimizer) in self._state_at_fit_end:
            return self._state_at_fit_end[id(optimizer)]  # after fit
        state = optimizer.state_dict()
        if runtime is None or runtime.group_size == 1:
            return state
        if self.global_rank // self.num_stages != 0:
            return {}  # replicas hold the same state as replica 0, which is what is saved
        parts: list[Any] = [None] * runtime.group_size if runtime.group_rank == 0 else []
        dist.gather_object(
            state["state"],
            parts if runtime.group_rank == 0 else None,
            dst=dist.get_global_rank(runtime.group, 0),
            group=runtime.group,
        )
        if runtime.group_rank != 0:
            return {}
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # The full state is loaded; once the pipeline is built, the entries of other ranks'
        # stages are dropped (_drop_foreign_optimizer_state), so any split can resume it.
        super().load_optimizer_state_dict(checkpoint)
        self._drop_foreign_optimizer_state()

    # -- shutdown ---------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown then leaves the process groups alone (see there)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Drop the pipeline and destroy the process groups this strategy made (the mesh's, the stages').

        Lightning leaves gloo groups to interpreter exit, where the mesh's groups outliving the
        pipeline sometimes aborted a worker that had trained successfully ("terminate called
        without an active exception"). They are ours, so they go here, after the fit's last
        transfer; the next ``setup_environment`` (a ``test()`` in the same process) makes new
        ones. The default group is Lightning's and stays. After an error they are left to the
        process's exit: destroying a group waits for its pending work, which a hung peer would
        never complete.
        """
        groups = self._own_groups()
        self._runtime = None
        self._step_grads = None
        self._blocks = None
        self._window_steps, self._window_wall, self._window_busy = 0, 0.0, []
        if not self._failed and dist.is_available() and dist.is_initialized():
            for group in groups:
                with suppress(ValueError):  # destroyed already (the caller tore everything down)
                    dist.destroy_process_group(group)
        self._mesh, self._pp_group, self._dp_group = None, None, None
        self._failed = False
        super().teardown()

    def _own_groups(self) -> list[dist.ProcessGroup]:
        """The mesh's groups of this rank, and any per-direction P2P groups the stages made."""
        candidates: list[Any] = [self._pp_group, self._dp_group]
        runtime = self._runtime
        if runtime is not None:
            stages = [*runtime.train_stages, *(s for _, eval_stages in runtime._eval.values() for s in eval_stages)]
            for stage in stages:
                candidates += [getattr(stage, "_downstream_group", None), getattr(stage, "_upstream_group", None)]
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


def _group_options(backend: str, timeout: timedelta | None) -> tuple[str, Any] | None:
    """``(backend, options)`` carrying ``timeout`` for a new process group; ``None`` for the defaults."""
    if timeout is None:
        return None
    options: Any
    if backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        # the generic options object: DeviceMesh reads its ``_timeout`` for new_group(timeout=...)
        options = Backend.Options(backend, timeout)
    return backend, options


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def _should_update_logs(module: pl.LightningModule) -> bool:
    """Whether Lightning writes step metrics at this step (``Trainer(log_every_n_steps=...)``)."""
    trainer = module._trainer
    if trainer is None:
        return False
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except (AttributeError, NotImplementedError):  # another Lightning version: log every step
        return True
