"""The pipeline strategy's claims: its bubble, its activation memory, balance="time", its step time.

K = 2 fork-started CPU processes joined by gloo, one torch thread each, run the strategy's own
:class:`~lightning_strategies.strategies.pipeline.PipelineRuntime` (the code ``"pipeline"``
runs under Lightning). Prints a header (machine, versions, date), then ``name value unit`` lines.

**Simulated device compute (the goal lines).** Two processes on a shared 2-vCPU machine fight
for the cores, so a compute-bound stage's time depends on the other load, not on the schedule.
The main figures therefore use *simulated* blocks: each is a small Linear + tanh (real
parameters, gradients and transfers) followed by a custom autograd function that sleeps
``cost x sim_ms`` in forward and twice that in backward, in proportion to the micro-batch's
rows: a stand-in for a GPU kernel the CPU waits on. Sleeping stages need no core, so two of
them overlap as two devices would. Every line computed on them says ``sim`` in the header
comment; the ``real_`` lines repeat the measurements with compute-bound blocks (Linear + tanh,
``--dim`` wide) as context.

    bubble_over_theory_{gpipe,1f1b}_M{M}   measured idle share / (K-1)/(M+K-1)      goal <= 1.15
    floor_bubble_over_theory_...            the same for a bare gloo loop of equal stages (below)
    bubble_over_floor_...                   measured idle share / the bare loop's
    idle_{gpipe,1f1b}_M{M}                  1 - compute / step span, measured (what the strategy logs)
    schedule_bubble_over_theory_...         the schedule's fill/drain alone (replay) / theory
    schedule_bubble_{gpipe,1f1b}_M{M}       the schedule's bubble fraction (replay of the recorded order)
    jitter_{gpipe,1f1b}_M{M}                share of the span lost to chunks the host stalled
    overhead_{gpipe,1f1b}_M{M}              share of the span spent between chunks: transfers, Python
    span_{gpipe,1f1b}_M{M}                  step time (ms)
    peak_activation_1f1b_over_gpipe_M{M}    stage 0's peak saved activations, 1F1B / GPipe
    peak_activation_theory_M{M}             K/M                                     goal: within 10%
    balance_time_over_params                step time, balance="time" / "params"    goal < 1
    balance_theory_time_over_params         the same ratio predicted from the block costs
    pipeline_step_over_unsplit              Lightning step, "pipeline" (K=2) / one process
    pipeline_step_theory_over_unsplit       (M+K-1) / (M K)

**How the bubble is measured.** Each rank records the start and end of every forward and
backward chunk, and of the last stage's loss (one ``time.perf_counter`` clock for all processes
of the machine); a barrier
starts every step and the step's span runs from the first rank's start to the last rank's end.
``idle`` is the share of the span a stage does not compute, averaged over stages: what the
strategy logs as ``pipeline/bubble_fraction``, and the measured bubble the goal line divides by
the theory. It holds three things, each measured apart:

- the schedule's fill and drain, the theory's bubble: the chunks are replayed in their recorded
  order, each lasting its stage's median forward, backward or loss over the setting's timed steps,
  with no time between them (a chunk starts when its stage is free and its input, the previous
  stage's forward or the next stage's backward of the same micro-batch, is done).
  ``schedule_bubble`` = 1 - compute / span of that timeline (a check of the schedule's order and
  of stage balance: with equal stages it equals the theory by construction, so it is context,
  not the goal). With equal stages it is (K-1)/(M+K-1); a stage slower
  than the other raises it (the last stage's loss; the real blocks below, when one process
  gets less of the CPU), by about M x the difference per micro-batch.
- ``jitter``: replayed with the measured durations instead, the span grows by what slow chunks
  (the host's other load stalling a process inside a chunk, time ``idle`` counts as compute)
  cost the pipeline.
- ``overhead``: the rest of the real span: transfers and Python between chunks.

**The transport's floor.** After each timed step every rank runs the order of chunks that step
recorded once more, bare: a gloo ``irecv`` posted when the chunk is due, a sleep of the typical
forward or backward chunk (the median over all stages, so the stages are equal), an ``isend``
not waited for; no schedule object, no autograd, no loss. Its idle share over the theory is
what the transfers, posted as the schedules post them, and a Python loop cost on this machine (a
gloo send or receive costs its caller 0.1-0.2 ms on loopback, whatever the size); a runtime
issuing the same transfers does not get below it, and ``bubble_over_floor`` is what the
strategy's runtime adds (stage bookkeeping, the last stage's loss, unequal stages).

Activations are counted by ``torch.autograd.graph.saved_tensors_hooks`` on stage 0: the bytes of
distinct non-parameter tensors saved for backward and still alive, peak over the step.

``balance_time_over_params`` uses a deliberately unbalanced model: two blocks of cost 8 with few
parameters and two of cost 1 with 5x more (a Linear plus a table of 4 x width rows read at one
row). Splitting by parameters puts both heavy blocks on one stage (17 : 1); timing them splits
the work 8 : 10. The predicted ratio replays the recorded schedules with the nominal costs.

``pipeline_step_over_unsplit`` fits the same simulated 4-block model with Lightning, under
``PipelineStrategy`` (1F1B, 2 fork-started processes) and on one process, alternating the two so
both see the same machine load; a fit's step time is its fastest per-batch wall time (hooks
``on_train_batch_start`` to ``on_train_batch_end`` on rank 0, the first two steps skipped): the
host's stalls of a sleeping process only ever add to a step, and the ratio is the median over
the rounds.

    python benchmarks/pipeline.py            # 7 repetitions (about 4 minutes)
    python benchmarks/pipeline.py --quick    # 1 repetition, smaller blocks (CI smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, median, pyplot, save_figure
from benchmarks._workers import run_workers
from lightning_strategies.comm.pipeline import PipelineRuntime, partition_blocks, profile_blocks

K = 2
MICROBATCHES = (1, 2, 4, 8, 16)
HEAVY, LIGHT = 8, 1  # costs of the unbalanced model's blocks
Event = tuple[int, str, int, float, float]  # (stage, "F"/"B"/"L" (the loss), micro-batch, start, end)


# -- blocks ---------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``fwd`` seconds in forward and ``bwd`` in backward (a simulated kernel)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd: float, bwd: float) -> Tensor:
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.bwd)
        return grad, None, None


class _SimBlock(nn.Module):
    """Linear + tanh, then a simulated kernel of ``cost x ms_per_row x rows`` (backward 2x).

    ``table_rows`` adds a parameter table read at one row: parameters without cost.
    """

    def __init__(self, dim: int, cost: float, ms_per_row: float, table_rows: int = 0) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros(table_rows, dim)) if table_rows else None
        self.seconds_per_row = cost * ms_per_row / 1e3

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.linear(x))
        if self.table is not None:
            y = y + self.table[0]
        fwd = self.seconds_per_row * x.shape[0]
        return _Sleep.apply(y, fwd, 2 * fwd)


class _Dense(nn.Module):
    """Linear + tanh, applied ``repeat`` times with the same weight (compute without parameters)."""

    def __init__(self, dim: int, repeat: int = 1) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.repeat = repeat

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.repeat):
            x = torch.tanh(self.linear(x))
        return x


class _Table(nn.Module):
    """A Linear plus a large table read at one row: many parameters, little compute."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros(rows, dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x)) + self.table[0]


def sim_balanced(dim: int, n: int, ms_per_row: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_SimBlock(dim, 1, ms_per_row) for _ in range(n)])


def sim_unbalanced(dim: int, ms_per_row: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        _SimBlock(dim, HEAVY, ms_per_row),
        _SimBlock(dim, HEAVY, ms_per_row),
        _SimBlock(dim, LIGHT, ms_per_row, table_rows=4 * dim),
        _SimBlock(dim, LIGHT, ms_per_row, table_rows=4 * dim),
    )


def real_balanced(dim: int, n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Dense(dim) for _ in range(n)])


def real_unbalanced(dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        _Dense(dim, repeat=HEAVY), _Dense(dim, repeat=HEAVY), _Table(dim, 4 * dim), _Table(dim, 4 * dim)
    )


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


# -- the timeline replay -------------------------------------------------------------------------


def replay(events: Sequence[Sequence[Event]], duration: Callable[[Event], float] | None = None) -> float:
    """The span of the recorded chunks with zero time between them (transfers and Python removed).

    Each rank runs its chunks in the recorded order; a chunk starts when its rank is free and its
    input is ready: stage ``s``'s forward of micro-batch ``i`` needs stage ``s-1``'s, its
    backward needs stage ``s+1``'s (the last stage's, its own forward, which precedes it).

    Args:
        events: per rank, its chunks by start time.
        duration: a chunk's duration; default the measured ``end - start``.

    Returns:
        The ideal span in seconds.
    """
    last_stage = max(e[0] for rank in events for e in rank)
    ends: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(events)
    pos = [0] * len(events)
    while any(p < len(rank) for p, rank in zip(pos, events, strict=True)):
        progressed = False
        for r, rank in enumerate(events):
            while pos[r] < len(rank):
                stage, kind, mb, t0, t1 = rank[pos[r]]
                if kind == "F":
                    dep = ("F", stage - 1, mb) if stage > 0 else None
                elif kind == "B":
                    dep = ("B", stage + 1, mb) if stage < last_stage else None
                else:  # the loss follows its forward on the same rank
                    dep = None
                if dep is not None and dep not in ends:
                    break
                start = max(free[r], ends[dep] if dep is not None else 0.0)
                free[r] = ends[(kind, stage, mb)] = start + (duration(rank[pos[r]]) if duration else t1 - t0)
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded chunks wait on each other: not a timeline of one step")
    return max(free)


def typical_durations(steps: Sequence[Sequence[Sequence[Event]]]) -> dict[tuple[int, str], float]:
    """Each stage's median forward and backward chunk over the given steps' timelines."""
    durations: dict[tuple[int, str], list[float]] = {}
    for events in steps:
        for rank in events:
            for e in rank:
                durations.setdefault((e[0], e[1]), []).append(e[4] - e[3])
    return {key: statistics.median(values) for key, values in durations.items()}


def analyse(
    starts: Sequence[float],
    ends: Sequence[float],
    events: Sequence[Sequence[Event]],
    typical: dict[tuple[int, str], float],
) -> dict[str, float]:
    """One step's timeline cut into the schedule's bubble, stalls (``jitter``) and ``overhead``.

    ``bubble``: the replay with every chunk lasting its stage's typical (median) forward or
    backward, ``1 - compute / span`` of that timeline (the schedule's fill and drain, for the
    stages' typical costs). ``jitter``: what the measured durations add to the replayed span
    (chunks the host stalled), ``overhead``: what the real span adds to that (transfers, Python
    between chunks), both as shares of the real span. ``idle``: ``1 - compute / real span``.
    """

    def typical_duration(e: Event) -> float:
        return typical[(e[0], e[1])]

    span = max(ends) - min(starts)
    ideal = replay(events)
    smooth = replay(events, typical_duration)
    busy = [sum(e[4] - e[3] for e in rank) for rank in events]
    return {
        "span": span,
        "idle": statistics.fmean(1.0 - b / span for b in busy),
        "bubble": statistics.fmean(1.0 - sum(map(typical_duration, rank)) / smooth for rank in events),
        "jitter": (ideal - smooth) / span,
        "overhead": (span - ideal) / span,
        "max_busy": max(busy),
    }


# -- measurements in the K worker processes --------------------------------------------------------


class _SavedBytes:
    """Live bytes of distinct non-parameter tensors saved for backward, and their peak."""

    def __init__(self, held: Sequence[Tensor]) -> None:
        # parameters and the batch's inputs are in memory whatever the schedule: not activations
        self.held = {t.untyped_storage().data_ptr() for t in held}
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t: Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.held:
            return t
        key = t.data_ptr()
        entry = self.refs.setdefault(key, [t.numel() * t.element_size(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return _Handle(self, key, t)

    def unpack(self, h: Any) -> Tensor:
        return h.t if isinstance(h, _Handle) else h

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]


class _Handle:
    def __init__(self, owner: _SavedBytes, key: int, t: Tensor) -> None:
        self.owner, self.key, self.t = owner, key, t

    def __del__(self) -> None:
        self.owner.release(self.key)


def _floor_step(
    order: Sequence[Event], seconds: dict[str, float], buffers: dict[tuple[str, int], Tensor], last_stage: int
) -> tuple[float, float, float]:
    """One step of this rank's recorded chunk order, run bare: the transport's floor.

    Each chunk receives its input with a gloo ``irecv`` posted when it is due (as the schedules
    do), sleeps ``seconds[kind]`` (the same for every stage: equal stages) and sends its result
    with ``isend`` without waiting for it. No schedule object, no autograd, no stage
    bookkeeping: what is left of the bubble beyond the theory is the cost of the transfers and
    of a Python loop on this machine, which a runtime posting the same transfers does not go
    below. One stage per rank (stage ``s`` on rank ``s``).

    Returns:
        ``(start, end, compute seconds)`` of this rank.
    """
    sends = []
    busy = 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for stage, kind, mb, _, _ in order:
        if kind == "L":  # the last stage's loss: runtime work, not the transport's
            continue
        src, dst = (stage - 1, stage + 1) if kind == "F" else (stage + 1, stage - 1)
        if 0 <= src <= last_stage:
            received = dist.irecv(buffers[("in" + kind, mb)], src)
            assert received is not None  # this rank is in the group
            received.wait()
        start = time.perf_counter()
        time.sleep(seconds[kind])
        busy += time.perf_counter() - start
        if 0 <= dst <= last_stage:
            sends.append(dist.isend(buffers[("out" + kind, mb)], dst))
    for work in sends:
        assert work is not None
        work.wait()
    return t0, time.perf_counter(), busy


def _steps(runtime: PipelineRuntime, x: Tensor, y: Tensor, reps: int, *, floor: bool = False) -> dict[str, list[Any]]:
    """Per step (``reps`` after one warm-up), :func:`analyse`'s figures and every rank's timeline.

    With ``floor``, each timed step is followed by a :func:`_floor_step` of the order that
    step recorded, its chunks lasting the typical forward and backward measured so far
    (the median over all stages' chunks): ``floor_idle`` per step, interleaved with the runtime's.
    """
    out: dict[str, list[Any]] = {
        key: [] for key in ("span", "idle", "bubble", "jitter", "overhead", "max_busy", "events", "floor_idle")
    }
    runtime.record_events(True)
    steps = []
    world = dist.get_world_size()
    chunk = x[: x.shape[0] // runtime.microbatches]
    buffers = {
        (f"{d}{kind}", mb): torch.zeros_like(chunk)
        for d in ("in", "out")
        for kind in "FB"
        for mb in range(runtime.microbatches)
    }
    seen: dict[str, list[float]] = {"F": [], "B": []}  # the floor's chunks (it has no loss)
    for rep in range(reps + 1):
        runtime.reset_timers()
        dist.barrier()
        t0 = time.perf_counter()
        runtime.step(x, y)
        t1 = time.perf_counter()
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, (t0, t1, runtime.events()))
        for rank_events in (r[2] for r in rows):
            for e in rank_events:
                if e[1] in seen:
                    seen[e[1]].append(e[4] - e[3])
        if rep:
            steps.append(([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))
        for p in runtime.stage_parameters:
            p.grad = None
        if floor and rep:
            assert runtime.group_size == world and runtime.num_stages == world, "the floor needs one stage per rank"
            seconds = {kind: statistics.median(values) for kind, values in seen.items()}
            mine = rows[dist.get_rank()][2]
            floor_rows: list[Any] = [None] * world
            dist.all_gather_object(floor_rows, _floor_step(mine, seconds, buffers, world - 1))
            span = max(r[1] for r in floor_rows) - min(r[0] for r in floor_rows)
            out["floor_idle"].append(statistics.fmean(1.0 - r[2] / span for r in floor_rows))
    runtime.record_events(False)
    # a stage's typical chunk over all timed steps: a step where the host stalled most chunks
    # of one stage does not make that stage look slower
    typical = typical_durations([events for _, _, events in steps])
    for starts, ends, events in steps:
        for key, value in analyse(starts, ends, events, typical).items():
            out[key].append(value)
        out["events"].append(events)
    return out


def _p2p_latency_ms(rank: int, numel: int, reps: int = 20) -> float:
    """One-way time of a micro-batch's activation between the two ranks (ping-pong / 2)."""
    t = torch.zeros(numel)
    t0 = 0.0
    for i in range(reps + 3):
        if i == 3:
            t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
    return 1e3 * (time.perf_counter() - t0) / reps / 2


def _parallel_efficiency(rank: int, stage: nn.Module, sample: Tensor, reps: int = 5) -> float:
    """Time of a stage's work run by one rank alone / by both ranks at once (1.0: two free cores)."""

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            stage(sample.requires_grad_()).sum().backward()
        return time.perf_counter() - t0

    alone = 0.0
    for turn in range(2):
        dist.barrier()
        if turn == rank:
            alone = work()
        dist.barrier()
    together = work()
    for p in stage.parameters():
        p.grad = None
    ratio = torch.tensor([alone / together], dtype=torch.float64)
    dist.all_reduce(ratio)
    return float(ratio) / 2


def _bubbles(
    rank: int, blocks: nn.Sequential, mb: int, dim: int, reps: int, sim: bool, out: dict[str, Any], prefix: str
) -> None:
    """Bubble, idle, overhead and span per schedule and M; for the simulated blocks (``sim``)
    also stage 0's peak activations and the transport's floor (:func:`_floor_step`)."""
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    for m in MICROBATCHES:
        g = torch.Generator().manual_seed(m)
        x, y = torch.randn(m * mb, dim, generator=g), torch.randn(m * mb, dim, generator=g)
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < K:
                continue  # 1F1B needs at least K micro-batches
            runtime = PipelineRuntime(
                blocks, counts=[len(blocks) // K] * K, schedule=schedule, microbatches=m, loss_fn=_loss,
                group=group, device=torch.device("cpu"),
            )  # fmt: skip
            result = _steps(runtime, x, y, reps, floor=sim)
            for key in ("span", "idle", "bubble", "jitter", "overhead", *(("floor_idle",) if sim else ())):
                out[f"{prefix}{key}_{schedule}_M{m}"] = median(result[key])
            if not sim:
                continue
            if rank == 0:
                saved = _SavedBytes([*blocks.parameters(), x])
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    dist.barrier()
                    runtime.step(x, y)
                out[f"peak_{schedule}_M{m}"] = saved.peak
            else:
                dist.barrier()
                runtime.step(x, y)
            for p in blocks.parameters():
                p.grad = None


def _balance(blocks: nn.Sequential, mb: int, dim: int, reps: int, world: int, costs: Sequence[float] | None) -> dict:
    """Step time with balance="time" / "params" (1F1B, M=8), measured and predicted by the replay."""
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    m = 8
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * mb, dim, generator=g), torch.randn(m * mb, dim, generator=g)
    seconds = torch.tensor(profile_blocks(blocks, x[:mb]), dtype=torch.float64)
    dist.all_reduce(seconds)
    seconds /= world
    splits = {
        "params": partition_blocks([sum(p.numel() for p in b.parameters()) for b in blocks], K),
        "time": partition_blocks(seconds.tolist(), K),
    }
    cpu = torch.device("cpu")
    runtimes = {
        name: PipelineRuntime(blocks, counts=c, schedule="1f1b", microbatches=m, loss_fn=_loss, group=group, device=cpu)
        for name, c in splits.items()
    }
    spans: dict[str, list[float]] = {name: [] for name in splits}
    busiest: dict[str, list[float]] = {name: [] for name in splits}
    events: dict[str, Any] = {}
    for _ in range(reps):  # interleaved, so both see the same machine load
        for name, runtime in runtimes.items():
            result = _steps(runtime, x, y, 1)
            spans[name] += result["span"]
            busiest[name] += result["max_busy"]
            events[name] = result["events"][-1]
    # The prediction: the same schedules replayed with each stage's nominal cost (the simulated
    # costs, or the profile of real blocks), forward 1/3 and backward 2/3 of a block's cost.
    nominal = list(costs) if costs is not None else seconds.tolist()
    predicted = {}
    for name, counts in splits.items():
        bounds = [sum(counts[:s]) for s in range(K + 1)]
        stage_cost = [sum(nominal[bounds[s] : bounds[s + 1]]) for s in range(K)]

        def nominal_duration(e: Event, cost: list[float] = stage_cost) -> float:
            return cost[e[0]] * {"F": 1, "B": 2}.get(e[1], 0) / 3  # the loss: not in the block costs

        predicted[name] = replay(events[name], nominal_duration)
    return {
        "split_params": splits["params"],
        "split_time": splits["time"],
        "time_over_params": median([t / p for t, p in zip(spans["time"], spans["params"], strict=True)]),
        "busiest": median([t / p for t, p in zip(busiest["time"], busiest["params"], strict=True)]),
        "theory": predicted["time"] / predicted["params"],
    }


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    sim_dim, sim_mb, dim, mb, reps = cfg["sim_dim"], cfg["sim_microbatch"], cfg["dim"], cfg["microbatch"], cfg["reps"]
    ms_per_row = cfg["sim_ms"] / sim_mb
    out: dict[str, Any] = {"p2p_ms": _p2p_latency_ms(rank, sim_dim * sim_mb)}
    # simulated device compute: the goal lines
    _bubbles(rank, sim_balanced(sim_dim, 2 * K, ms_per_row), sim_mb, sim_dim, reps, True, out, "")
    unbalanced_costs = [HEAVY * cfg["sim_ms"], HEAVY * cfg["sim_ms"], LIGHT * cfg["sim_ms"], LIGHT * cfg["sim_ms"]]
    for key, value in _balance(
        sim_unbalanced(sim_dim, ms_per_row), sim_mb, sim_dim, reps, world, [3 * c for c in unbalanced_costs]
    ).items():
        out[f"balance_{key}"] = value
    # real compute: context
    blocks = real_balanced(dim, 2 * K)
    sample = torch.randn(mb, dim)
    out["real_compute_ms"] = 1e3 * sum(profile_blocks(blocks[:2], sample))  # one stage, one micro-batch
    out["real_parallel_efficiency"] = _parallel_efficiency(rank, blocks[:2], sample)
    _bubbles(rank, blocks, mb, dim, cfg["real_reps"], False, out, "real_")
    # the heavy blocks are 8x a balanced block: halve the width (1/4 the FLOPs)
    for key, value in _balance(real_unbalanced(dim // 2), mb, dim // 2, cfg["real_reps"], world, None).items():
        out[f"real_balance_{key}"] = value
    return out


# -- Lightning: pipeline step time against one process ---------------------------------------------


def _lightning_step_ratio(cfg: dict[str, Any], rounds: int, steps: int, m: int) -> dict[str, float]:
    """Median step seconds of "pipeline" (K fork-started processes) and of one process, alternated."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_strategies.strategies.pipeline import PipelineStrategy

    dim, mb = cfg["sim_dim"], cfg["sim_microbatch"]
    ms_per_row = cfg["sim_ms"] / mb

    class SimModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = sim_balanced(dim, 2 * K, ms_per_row)

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x)

        def pipeline_layers(self) -> nn.Sequential:
            return self.net

        def pipeline_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
            return _loss(outputs, targets)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            loss = _loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(pl.Callback):
        def __init__(self, path: Path) -> None:
            self.path, self.t0 = path, 0.0
            self.seconds: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.seconds.append(time.perf_counter() - self.t0)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self.path.write_text(json.dumps(self.seconds))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * m * mb, dim, generator=g), torch.randn(steps * m * mb, dim, generator=g))

    def fit(strategy: Any, devices: int, path: Path) -> float:
        trainer = pl.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            callbacks=[StepTimer(path)], use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(SimModule(), DataLoader(data, batch_size=m * mb))
        return min(json.loads(path.read_text())[2:])

    pipe, single = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            single.append(fit("auto", 1, Path(tmp) / f"single{r}.json"))
            strategy = PipelineStrategy(schedule="1f1b", microbatches=m, start_method="fork")
            pipe.append(fit(strategy, K, Path(tmp) / f"pipe{r}.json"))
    return {
        "ratio": median([p / s for p, s in zip(pipe, single, strict=True)]),
        "pipe_ms": 1e3 * median(pipe),
        "single_ms": 1e3 * median(single),
    }


# -- main -------------------------------------------------------------------------------------------


def run_world(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """K forked processes with a gloo group; rank 0's results (killed past ``timeout``)."""
    return dict(run_workers(_measure, K, cfg, timeout=timeout)[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 repetition, smaller blocks (CI smoke run)")
    # 2 cost-1 blocks per stage: 20 ms forward + 40 ms backward per micro-batch and stage, against
    # transfers and Python between chunks (`overhead`, ~1 ms a chunk on a loaded machine) and the
    # last stage's loss (~0.3 ms more per backward: at M=16 it moves the bubble by ~8% of theory)
    parser.add_argument(
        "--sim-ms", type=float, default=10.0, help="simulated forward ms of a cost-1 block per micro-batch"
    )
    parser.add_argument("--sim-dim", type=int, default=256, help="width of the simulated blocks")
    parser.add_argument("--sim-microbatch", type=int, default=32, help="samples per micro-batch (simulated)")
    parser.add_argument("--dim", type=int, default=1024, help="width of the real-compute blocks")
    parser.add_argument("--microbatch", type=int, default=64, help="samples per micro-batch (real compute)")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per setting (median)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated Lightning fits per side")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the measurements in workers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, m = 10, 4
    if args.quick:
        args.sim_ms, args.sim_dim, args.dim, args.microbatch, args.reps, args.rounds = 1.0, 64, 256, 16, 1, 1
        steps = 4
    cfg = {
        "sim_ms": args.sim_ms, "sim_dim": args.sim_dim, "sim_microbatch": args.sim_microbatch, "dim": args.dim,
        "microbatch": args.microbatch, "reps": args.reps, "real_reps": max(1, (args.reps + 1) // 2),
    }  # fmt: skip
    print(header(f"pipeline: K={K} CPU processes (gloo, 1 thread each)"), flush=True)
    print(
        f"# sim: simulated device compute, blocks {args.sim_dim} wide sleeping {args.sim_ms:g} ms x cost per "
        f"micro-batch of {args.sim_microbatch} in forward, 2x in backward; real_: Linear+tanh {args.dim} wide, "
        f"micro-batch {args.microbatch}",
        flush=True,
    )
    r = run_world(cfg, args.timeout)
    r.update({f"lightning_{k}": v for k, v in _lightning_step_ratio(cfg, args.rounds, steps, m).items()})
    for prefix in ("", "real_"):
        for schedule in ("gpipe", "1f1b"):
            for mm in MICROBATCHES:
                theory = (K - 1) / (mm + K - 1)
                idle, bubble = r.get(f"{prefix}idle_{schedule}_M{mm}"), r.get(f"{prefix}bubble_{schedule}_M{mm}")
                if idle is not None and bubble is not None:
                    line(f"{prefix}bubble_over_theory_{schedule}_M{mm}", idle / theory, "x")
                    line(f"{prefix}schedule_bubble_over_theory_{schedule}_M{mm}", bubble / theory, "x")
                floor = r.get(f"{prefix}floor_idle_{schedule}_M{mm}")
                if idle is not None and floor is not None:
                    line(f"{prefix}floor_bubble_over_theory_{schedule}_M{mm}", floor / theory, "x")
                    line(f"{prefix}bubble_over_floor_{schedule}_M{mm}", idle / floor, "x")
        units = {"idle": "fraction", "bubble": "fraction", "jitter": "fraction", "overhead": "fraction", "span": "ms"}
        for key, unit in units.items():
            for schedule in ("gpipe", "1f1b"):
                for mm in MICROBATCHES:
                    name = f"{prefix}{key}_{schedule}_M{mm}"
                    if name in r:
                        shown = f"{prefix}schedule_bubble_{schedule}_M{mm}" if key == "bubble" else name
                        line(shown, r[name] * (1e3 if unit == "ms" else 1), unit)
        if not prefix:
            for mm in MICROBATCHES:
                if f"peak_1f1b_M{mm}" in r:
                    line(f"peak_activation_1f1b_over_gpipe_M{mm}", r[f"peak_1f1b_M{mm}"] / r[f"peak_gpipe_M{mm}"], "x")
                    line(f"peak_activation_theory_M{mm}", K / mm, "x")
        line(f"{prefix}balance_time_over_params", r[f"{prefix}balance_time_over_params"], "x")
        line(f"{prefix}balance_theory_time_over_params", r[f"{prefix}balance_theory"], "x")
        # the slowest stage's compute per step, time / params: what balancing changes
        line(f"{prefix}balance_busiest_stage_time_over_params", r[f"{prefix}balance_busiest"], "x")
        print(
            f"# {prefix or 'sim '}blocks per stage: params {r[f'{prefix}balance_split_params']}, "
            f"time {r[f'{prefix}balance_split_time']}",
            flush=True,
        )
    line("pipeline_step_over_unsplit", r["lightning_ratio"], "x")
    line("pipeline_step_theory_over_unsplit", (m + K - 1) / (m * K), "x")
    line("pipeline_step_ms", r["lightning_pipe_ms"], "ms")
    line("unsplit_step_ms", r["lightning_single_ms"], "ms")
    print(f"# Lightning fits: 1F1B, M={m}, simulated 4-block model, {steps} steps x {args.rounds} rounds", flush=True)
    # what the overhead is made of: one transfer's latency; the real blocks' compute and how far
    # the machine runs two compute-bound processes at once (1.0: two free cores)
    line("p2p_one_way_ms", r["p2p_ms"], "ms")
    line("real_compute_ms_per_microbatch_stage", r["real_compute_ms"], "ms")
    line("real_cpu_parallel_efficiency", r["real_parallel_efficiency"], "x")
    if not args.quick:
        plot_bubble(r, Path(__file__).parent / "results" / "pipeline.png", stage_ms=3 * 2 * args.sim_ms)
    return 0


def plot_bubble(r: dict[str, Any], path: Path, *, stage_ms: float) -> None:
    """The seed's claim 5: bubble, bubble / theory and step time against M."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax, ax_r, ax_t) = plt.subplots(1, 3, figsize=(15, 3.8))
    spans: list[float] = []
    for schedule, marker, color in (("gpipe", "o", "tab:blue"), ("1f1b", "s", "tab:orange")):
        ms = [m for m in MICROBATCHES if f"bubble_{schedule}_M{m}" in r]
        theory = [(K - 1) / (m + K - 1) for m in ms]
        for key, style, alpha, label in (
            ("idle", "-", 1.0, "measured (sim)"),
            ("real_idle", "--", 0.5, "measured (real compute)"),
        ):
            ax.plot(ms, [r[f"{key}_{schedule}_M{m}"] for m in ms], marker + style, color=color, alpha=alpha,
                    label=f"{schedule} {label}")  # fmt: skip
        for key, style, alpha, label in (
            ("idle", "-", 1.0, "measured (sim)"),
            ("floor_idle", "-.", 0.7, "bare gloo loop, equal stages (floor)"),
            ("bubble", ":", 0.7, "schedule fill/drain alone (replay)"),
        ):
            if all(f"{key}_{schedule}_M{m}" in r for m in ms):
                ratios = [r[f"{key}_{schedule}_M{m}"] / t for m, t in zip(ms, theory, strict=True)]
                ax_r.plot(ms, ratios, marker + style, color=color, alpha=alpha, label=f"{schedule} {label}")
        spans = [*spans, *(1e3 * r[f"span_{schedule}_M{m}"] for m in ms)]
        ax_t.plot(ms, spans[-len(ms) :], marker + "-", color=color, label=f"{schedule} (sim)")
    ax.plot(MICROBATCHES, [(K - 1) / (m + K - 1) for m in MICROBATCHES], "k--", label="(K-1)/(M+K-1)")
    ax_r.axhline(1.15, color="k", linestyle="--", linewidth=1, label="goal 1.15")
    ax_r.axhline(1.0, color="grey", linewidth=0.8)
    ax_t.plot(MICROBATCHES, [(m + K - 1) * stage_ms for m in MICROBATCHES], "k--", label="(M+K-1) x nominal (F+B)")
    for a in (ax, ax_r, ax_t):
        a.set_xscale("log", base=2)
        a.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
        a.set_xlabel("micro-batches M")
        a.legend(fontsize=7)
    ax.set_ylabel("idle share of a step")
    ax.set_title(f"pipeline bubble, K={K}", fontsize=9)
    ax_r.set_ylabel("bubble / (K-1)/(M+K-1)")
    ax_r.set_title("bubble over theory: runtime, transport floor, schedule alone", fontsize=9)
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_yscale("log")
    ax_t.set_yticks([t for t in (50, 100, 200, 500, 1000, 2000, 5000, 10000) if t <= 2 * max(spans)])
    ax_t.yaxis.set_major_formatter(ScalarFormatter())
    ax_t.yaxis.set_minor_formatter(NullFormatter())
    ax_t.set_title(f"step time, simulated stages of {stage_ms:g} ms per micro-batch (F+B)", fontsize=9)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
