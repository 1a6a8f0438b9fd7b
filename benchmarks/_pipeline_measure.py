"""The measurements of ``benchmarks/pipeline.py``, run in K fork-started gloo processes (and one Lightning comparison).

- :func:`measure`: per worker, the runtime's steps with their timelines analysed
  (:func:`~benchmarks._pipeline_timeline.analyse`), the transport's floor, stage 0's peak
  activations, the balance experiment, and the machine's context (one transfer's latency, how
  far two compute-bound processes run at once).
- :func:`lightning_step_ratio`: step time of ``"pipeline"`` under Lightning against one process.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._common import median
from benchmarks._pipeline_models import (
    HEAVY,
    LIGHT,
    SimModule,
    loss,
    real_balanced,
    real_unbalanced,
    sim_balanced,
    sim_unbalanced,
)
from benchmarks._pipeline_timeline import analyse, replay, typical_durations
from lightning_strategies.comm.pipeline import Event, PipelineRuntime, partition_blocks, profile_blocks
from lightning_strategies.strategies.pipeline import PipelineStrategy

__all__ = ["MICROBATCHES", "K", "lightning_step_ratio", "measure"]

K = 2  # pipeline stages, one per worker process
MICROBATCHES = (1, 2, 4, 8, 16)


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
                blocks, counts=[len(blocks) // K] * K, schedule=schedule, microbatches=m, loss_fn=loss,
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
        name: PipelineRuntime(blocks, counts=c, schedule="1f1b", microbatches=m, loss_fn=loss, group=group, device=cpu)
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


def measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One worker's measurements (every figure ``main`` prints except the Lightning comparison)."""
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


def lightning_step_ratio(cfg: dict[str, Any], rounds: int, steps: int, m: int) -> dict[str, float]:
    """Median step seconds of "pipeline" (K fork-started processes) and of one process, alternated."""
    dim, mb = cfg["sim_dim"], cfg["sim_microbatch"]
    ms_per_row = cfg["sim_ms"] / mb

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
        trainer.fit(SimModule(dim, 2 * K, ms_per_row), DataLoader(data, batch_size=m * mb))
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
