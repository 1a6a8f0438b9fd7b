"""The pipeline without Lightning: the block partition, block profiling, the runtime.

:class:`PipelineRuntime` is one rank's stages and their ``torch.distributed.pipelining`` schedules, with
compute timers per stage and an optional timeline of chunks (:data:`Event`). Which blocks a rank holds, and
checkpoints of a split model, are :mod:`~lightning_strategies.comm.pipeline_stages`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from typing_extensions import override

__all__ = [
    "SCHEDULES",
    "Event",
    "PipelineRuntime",
    "average_gradients",
    "partition_blocks",
    "profile_blocks",
    "profile_blocks_with_output",
]

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}

LossFn = Callable[[Tensor, Tensor], Tensor]
Event = tuple[int, str, int, float, float]
"""One chunk of a step: ``(stage, kind, micro-batch, start, end)``, kind ``"F"``, ``"B"`` or ``"L"``
(the last stage's loss), ``time.perf_counter()`` seconds (one clock for all processes of a machine)."""


def partition_blocks(costs: Sequence[float], parts: int) -> list[int]:
    """Split blocks into ``parts`` contiguous groups of at least one block, minimising the largest cost.

    The slowest stage sets a pipeline's pace, so the objective is the maximum, not the spread.

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
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    # best[k][i]: the smallest possible largest group cost of the first i blocks in k groups
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
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

    Each block runs on the previous one's detached output with an all-ones output gradient; the RNG,
    the buffers and the gradients are restored, so profiling leaves no trace on training.
    """
    return profile_blocks_with_output(blocks, sample, repeats=repeats)[0]


def profile_blocks_with_output(
    blocks: nn.Sequential, sample: Tensor, *, repeats: int = 3
) -> tuple[list[float], Tensor]:
    """:func:`profile_blocks`, and the last block's (detached) output: the next stage's sample.

    On CUDA each block is timed with a pair of events; the host waits once per round.
    """
    params = [p for p in blocks.parameters()]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in blocks.buffers()]
    times: list[list[float]] = [[] for _ in blocks]
    cuda = sample.device.type == "cuda"
    devices = [sample.device] if cuda else []
    x = sample
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for _ in range(repeats + 1):  # the first round warms up allocators and kernels
                x = sample
                events: list[tuple[Any, Any]] = []
                for i, block in enumerate(blocks):
                    inp = x.detach().requires_grad_(x.is_floating_point())
                    if cuda:
                        events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                        events[-1][0].record()
                    t0 = time.perf_counter()
                    out = block(inp)
                    if out.requires_grad:
                        torch.autograd.backward(out, torch.ones_like(out))
                    if cuda:
                        events[-1][1].record()
                    else:
                        times[i].append(time.perf_counter() - t0)
                    x = out.detach()
                if cuda:
                    events[-1][1].synchronize()
                    for i, (start, end) in enumerate(events):
                        times[i].append(start.elapsed_time(end) / 1000.0)
    finally:
        with torch.no_grad():
            for b, saved in zip(blocks.buffers(), buffers, strict=True):
                b.copy_(saved)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return [sorted(t[1:])[len(t[1:]) // 2] for t in times], x


class _Timer:
    """Seconds of marked spans of work on one device, read when asked, not when marked.

    On CUDA the host only enqueues kernels, so a span is a pair of events on the current stream, read by
    :meth:`seconds` (one wait for the last event); marking never waits for the device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)
        self._seconds = 0.0
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> tuple[float, Any]:
        if self._device.type != "cuda":
            return time.perf_counter(), None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return time.perf_counter(), event

    def stop(self, start: tuple[float, Any]) -> tuple[float, float]:
        """Mark the span's end; return its host start and end (enqueue times on CUDA)."""
        t0, begun = start
        t1 = time.perf_counter()
        if begun is None:
            self._seconds += t1 - t0
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self._device))
            self._spans.append((begun, end))
        return t0, t1

    def seconds(self) -> float:
        """Seconds of all spans since :meth:`reset` (on CUDA: waits for the last span's end event)."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._spans) / 1000.0
            self._spans = []
        return self._seconds

    def reset(self) -> None:
        self._seconds = 0.0
        self._spans = []


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` adding up the seconds it computes (chunks; the loss via :meth:`record_loss`) and,
    with ``events`` a list, appending each chunk's :data:`Event`. Transfers happen outside these calls, so the
    rest of a step is bubble or communication. Backward runs with autocast off, as Lightning's does."""

    timer: _Timer
    events: list[Event] | None = None
    autocast_off: Callable[[], AbstractContextManager[Any]] = nullcontext
    _awaiting_loss: int | None = None  # the micro-batch forwarded last, until its loss

    def record_loss(self, start: tuple[float, Any]) -> bool:
        """Count the loss of the micro-batch forwarded last, computed since ``start``, as compute; whether it
        was one of the step's (the schedule's shape inference on the first step is not)."""
        if self._awaiting_loss is None:
            return False
        self._record("L", self._awaiting_loss, start)
        self._awaiting_loss = None
        return True

    def _record(self, kind: str, chunk: int, start: tuple[float, Any]) -> None:
        t0, t1 = self.timer.stop(start)
        if self.events is not None:
            self.events.append((self.stage_index, kind, chunk, t0, t1))

    @override
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = self.timer.start()
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._record("F", fwd_chunk_id, start)
            self._awaiting_loss = fwd_chunk_id

    @override
    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        start = self.timer.start()
        try:
            with self.autocast_off():
                super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self._record("B", bwd_chunk_id, start)


class PipelineRuntime:
    """This rank's stages of a pipeline, its training schedule and its forward-only schedules.

    Stage ``s`` of ``S = group_size x stages_per_rank`` lives on group rank ``s % group_size``.

    Args:
        blocks: the whole model as ordered blocks (shared with the LightningModule).
        counts: blocks per stage, ``S`` entries summing to ``len(blocks)``.
        schedule: a key of :data:`SCHEDULES`.
        loss_fn: the mean loss of a micro-batch, ``loss_fn(outputs, targets)``.
        group: the pipeline's process group (this replica's stages).
        autocast: the context of the forward chunks and the loss (``None``: full precision).
        loss_scaler: multiplies the last stage's loss before its backward (``None``: no scaling).
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
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        loss_scaler: Callable[[Tensor], Tensor] | None = None,
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
        self.device = torch.device(device)
        self.counts = list(counts)
        self._loss_fn = loss_fn
        self._loss_scale = 1.0
        self._autocast = autocast
        self._loss_scaler = loss_scaler
        self._raw_losses: list[Tensor] = []
        self.blocks = blocks
        self.bounds = [0, *accumulate(counts)]
        self.stage_indices = list(range(self.group_rank, self.num_stages, self.group_size))
        self.submodules = [nn.Sequential(*blocks[self.bounds[s] : self.bounds[s + 1]]) for s in self.stage_indices]
        for stage, submodule in zip(self.stage_indices, self.submodules, strict=True):
            if any(t.is_meta for t in (*submodule.parameters(), *submodule.buffers())):
                raise ValueError(
                    f"PipelineRuntime found stage {stage}'s blocks on the meta device on group rank {self.group_rank}, "
                    "which holds that stage: expected its tensors materialised here. Fix: distribute the blocks "
                    "first (lightning_strategies.comm.pipeline_stages.distribute_blocks)."
                )
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices
        self.last_rank = (self.num_stages - 1) % self.group_size
        self.train_stages = self._make_stages()
        self.train_schedule = self._make_schedule(self.train_stages, loss=True)
        # Forward-only schedules with stages of their own, one per (padded) batch size: a stage
        # infers its buffers' shapes from its first batch, and switching one schedule between
        # train and eval mode would redo that inference (a forward pass) at every switch.
        self._eval: dict[int, tuple[Any, list[_TimedStage]]] = {}
        self._step_timer = _Timer(self.device)
        self._steps = 0
        self._output_meta: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        self.last_outputs: Tensor | None = None

    @property
    def stage_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of all its stages), the ones it computes gradients for."""
        return [p for m in self.submodules for p in m.parameters()]

    def stage_groups(self) -> list[dist.ProcessGroup]:
        """The per-direction point-to-point groups the stages made (training and forward-only), if any."""
        stages = [*self.train_stages, *(s for _, eval_stages in self._eval.values() for s in eval_stages)]
        groups = [getattr(s, name, None) for s in stages for name in ("_downstream_group", "_upstream_group")]
        return [g for g in groups if isinstance(g, dist.ProcessGroup)]

    def _make_stages(self) -> list[_TimedStage]:
        stages = [
            _TimedStage(m, s, self.num_stages, self.device, group=self.group)
            for m, s in zip(self.submodules, self.stage_indices, strict=True)
        ]
        device_type = self.device.type
        for stage in stages:
            stage.timer = _Timer(self.device)
            if self._autocast is not None:
                stage.autocast_off = lambda: torch.autocast(device_type, enabled=False)
        return stages

    def _scaled_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        start = self.train_stages[-1].timer.start()
        raw = self._loss_fn(outputs, targets)
        loss = raw * self._loss_scale
        if self._loss_scaler is not None:
            loss = self._loss_scaler(loss)
        # only the training schedule has a loss, on the rank that holds the last stage
        if self.train_stages[-1].record_loss(start):
            self._raw_losses.append(raw.detach())
        return loss

    def _make_schedule(self, stages: list[_TimedStage], *, loss: bool) -> Any:
        cls = SCHEDULES[self.schedule_name]
        loss_fn = self._scaled_loss if loss else None
        # scale_grads=False: the loss is scaled instead (1 / (microbatches x accumulation)), so
        # gradients accumulated across Lightning micro-steps are not divided again at each step.
        if cls is ScheduleInterleaved1F1B:
            return cls(list[Any](stages), self.microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)

    def _autocast_context(self) -> AbstractContextManager[Any]:
        return self._autocast() if self._autocast is not None else nullcontext()

    def stage_seconds(self, stages: list[_TimedStage] | None = None) -> list[float]:
        """Compute seconds of each local stage since :meth:`reset_timers` (on CUDA, waits for the device once)."""
        return [s.timer.seconds() for s in (stages or self.train_stages)]

    @property
    def last_step_seconds(self) -> float:
        """Wall seconds of the steps since the last :meth:`reset_timers` (CUDA: device time, read now)."""
        return self._step_timer.seconds()

    def reset_timers(self) -> None:
        """Zero the compute and step seconds (and empty the timeline, when one is recorded)."""
        for s in self.train_stages:
            s.timer.reset()
            if s.events is not None:
                s.events = []
        self._step_timer.reset()
        self._steps = 0

    def read_timings(self) -> tuple[int, float, list[float]]:
        """The steps since the last read, their wall seconds and each local stage's compute seconds, then
        zeroed timers; on CUDA the one wait for the device, once per logging step."""
        steps, wall, busy = self._steps, self.last_step_seconds, self.stage_seconds()
        self.reset_timers()
        return steps, wall, busy

    def record_events(self, on: bool = True) -> None:
        """Keep (or stop keeping) the timeline of the training chunks, read by :meth:`events`."""
        for s in self.train_stages:
            s.events = [] if on else None

    def events(self) -> list[Event]:
        """This rank's chunks since :meth:`reset_timers`, by start."""
        return sorted((e for s in self.train_stages for e in s.events or ()), key=lambda e: e[3])

    def step(self, inputs: Tensor | None, targets: Tensor | None, *, loss_scale: float = 1.0) -> Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch's inputs (used on the rank holding stage 0).
            targets: the batch's targets (used on the rank holding the last stage).
            loss_scale: extra factor on the loss, ``1 / accumulation steps``.

        Returns:
            On the rank holding the last stage, the batch's mean loss (detached, unscaled), the outputs
            kept in :attr:`last_outputs`; elsewhere ``None``.
        """
        self._loss_scale = loss_scale / self.microbatches
        self._raw_losses = []
        args = (inputs,) if self.has_first else ()
        self.last_outputs = None
        start = self._step_timer.start()
        with self._autocast_context():
            out = self.train_schedule.step(*args, target=targets if self.has_last else None)
        self._step_timer.stop(start)
        self._steps += 1
        if not self.has_last:
            return None
        self.last_outputs = out.detach()
        return torch.stack(self._raw_losses).mean()

    def forward(self, inputs: Tensor) -> Tensor | None:
        """The last stage's outputs for ``inputs`` on the rank holding it (else ``None``), without gradients.

        A batch whose size is not a multiple of the micro-batches is padded with copies of its last sample
        and the outputs cut back, so no evaluation sample is dropped.
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
        with torch.inference_mode(False), torch.no_grad(), self._autocast_context():
            x = inputs.clone() if inputs.is_inference() else inputs
            if padded != size:
                x = torch.cat([x, x[-1:].expand(padded - size, *x.shape[1:])])
            out = schedule.eval(x) if self.has_first else schedule.eval()
        for s in stages:
            s.timer.reset()
        return out[:size] if self.has_last else None

    def broadcast_from_last(self, tensor: Tensor | None, key: Any = None) -> Tensor:
        """The last stage's tensor on every rank of the pipeline.

        Shape and dtype travel once per ``key`` (alike on every rank, e.g. the batch's shape and the mode);
        ``key=None`` always sends them.
        """
        if self.group_size == 1:
            assert tensor is not None
            return tensor
        meta = self._output_meta.get(key) if key is not None else None
        if meta is None:
            box: list[Any] = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
            dist.broadcast_object_list(box, group=self.group, device=self.device, group_src=self.last_rank)
            meta = box[0]
            if key is not None:
                self._output_meta[key] = meta
        shape, dtype = meta
        tensor = torch.empty(shape, dtype=dtype, device=self.device) if tensor is None else tensor.contiguous()
        dist.broadcast(tensor, group=self.group, group_src=self.last_rank)
        return tensor

    # -- collectives over the pipeline's group (every rank of the group calls them) -----------------

    def gather_timings(self, wall: float, busy: Sequence[float]) -> tuple[dict[int, float], float]:
        """Every stage's compute seconds and the pipeline's bubble fraction, on every rank of the group.

        Args:
            wall: this rank's seconds per step.
            busy: compute seconds per step of each of this rank's stages.

        Returns:
            ``{stage: compute seconds}``, and the mean over ranks of the share of a step not spent computing.
        """
        # on the group's device (an NCCL group has no CPU backend), read back in one transfer
        mine = torch.tensor([wall, *busy], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.group_size)]
        dist.all_gather(gathered, mine, group=self.group)
        seconds: dict[int, float] = {}
        idle = []
        for rank, row in enumerate(torch.stack(gathered).tolist()):
            rank_wall, rank_busy = row[0], row[1:]
            idle.append(max(0.0, 1.0 - sum(rank_busy) / rank_wall) if rank_wall > 0 else 0.0)
            for v, stage_seconds in enumerate(rank_busy):
                seconds[rank + v * self.group_size] = stage_seconds
        return seconds, sum(idle) / len(idle)


def average_gradients(grads: Sequence[Tensor], group: dist.ProcessGroup | None) -> int:
    """Average ``grads`` in place over ``group`` (``None``: the world) by one flat all-reduce (a collective);
    returns the flat tensor's bytes (0 when nothing was sent: no gradients, or a group of one)."""
    size = dist.get_world_size(group)
    if size == 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # gloo has no AVG: sum, then divide
    flat /= size
    for g, avg in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(avg.view_as(g))
    return flat.numel() * flat.element_size()
