"""The pipeline strategy's claims: its bubble, its activation memory, and balance="time".

K = 2 fork-started CPU processes joined by gloo, one torch thread each, run the strategy's own
:class:`~lightning_strategies.strategies.pipeline.PipelineRuntime` (the code ``"pipeline"``
runs under Lightning) on synthetic blocks. Prints a header (machine, versions, date), then
``name value unit`` lines:

    bubble_over_theory_{gpipe,1f1b}_M{M}   measured bubble / (K-1)/(M+K-1)          goal <= 1.15
    bubble_{gpipe,1f1b}_M{M}                the measured bubble fraction itself
    peak_activation_1f1b_over_gpipe_M{M}    stage 0's peak saved activations, 1F1B / GPipe
    peak_activation_theory_M{M}             K/M                                     goal: within 10%
    balance_time_over_params                step time, balance="time" / "params"    goal < 1
    balance_busiest_stage_time_over_params  the busiest stage's compute per step, same ratio

The bubble is measured as the strategy logs ``pipeline/bubble_fraction``: per stage, the share
of a step's wall time not spent computing (forward / backward chunks), averaged over stages; a
barrier starts every step. Blocks are balanced (equal Linear+tanh blocks) and each micro-batch
has the same size, so the theory's equal-F, equal-B assumption holds; transfers, Python
overhead between chunks, and the other processes sharing the cores count as bubble.

Activations are counted by ``torch.autograd.graph.saved_tensors_hooks`` on stage 0: the bytes of
distinct non-parameter tensors saved for backward and still alive, peak over the step.

Context lines, measured in the same run: ``compute_ms_per_microbatch_stage``, ``p2p_one_way_ms``
(one transfer's latency) and ``cpu_parallel_efficiency`` (one stage's work run by one process
alone / by both at once: 1.0 when two cores are free; a pipeline can only overlap its stages,
and approach the theory, as far as the machine runs both processes at once).

``balance_time_over_params`` uses a deliberately unbalanced model: two compute-heavy blocks with
few parameters (one Linear applied 8 times) and two light blocks with 5x more (a Linear plus a
table of 4 x width rows read at one row). Splitting by parameters puts both heavy blocks on one stage; timing
them splits the work evenly.

    python benchmarks/pipeline.py            # 7 repetitions, micro-batch 64 x 1024 (~1 min)
    python benchmarks/pipeline.py --quick    # 2 repetitions, smaller blocks (seconds, for CI)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, median, pyplot, save_figure
from benchmarks._workers import run_workers
from lightning_strategies.strategies.pipeline import PipelineRuntime, partition_blocks, profile_blocks

K = 2
MICROBATCHES = (1, 2, 4, 8, 16)


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


def balanced_blocks(dim: int, n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Dense(dim) for _ in range(n)])


def unbalanced_blocks(dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Dense(dim, repeat=8), _Dense(dim, repeat=8), _Table(dim, 4 * dim), _Table(dim, 4 * dim))


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(out, target)


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


def _steps(runtime: PipelineRuntime, x: Tensor, y: Tensor, reps: int) -> dict[str, list[float]]:
    """Per step (``reps`` after one warm-up): bubble fraction (mean over stages), wall seconds
    (slowest rank) and the busiest stage's compute seconds."""
    out: dict[str, list[float]] = {"bubble": [], "wall": [], "max_busy": []}
    for rep in range(reps + 1):
        runtime.reset_timers()
        dist.barrier()
        runtime.step(x, y)
        wall, busy = runtime.last_step_seconds, sum(runtime.stage_seconds())
        row = torch.tensor([1.0 - busy / wall, wall, busy], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        if rep:
            out["bubble"].append(sum(float(r[0]) for r in rows) / len(rows))
            out["wall"].append(max(float(r[1]) for r in rows))
            out["max_busy"].append(max(float(r[2]) for r in rows))
        for p in runtime.stage_parameters:
            p.grad = None
    return out


def _p2p_latency_ms(rank: int, numel: int, reps: int = 20) -> float:
    """One-way time of a micro-batch's activation between the two ranks (ping-pong / 2)."""
    t = torch.zeros(numel)
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
    """Time of a stage's work run by one rank alone / by both ranks at once (1.0: two free cores).

    A pipeline overlaps its stages only if the machine runs both processes at the same time;
    on a shared machine the other load decides how much.
    """

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


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    dim, mb, reps = cfg["dim"], cfg["microbatch"], cfg["reps"]
    device = torch.device("cpu")
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    out: dict[str, Any] = {"p2p_ms": _p2p_latency_ms(rank, dim * mb)}
    blocks = balanced_blocks(dim, 2 * K)
    sample = torch.randn(mb, dim)
    out["compute_ms"] = 1e3 * sum(profile_blocks(blocks[:2], sample))  # one stage, one micro-batch
    out["parallel_efficiency"] = _parallel_efficiency(rank, blocks[:2], sample)
    for m in MICROBATCHES:
        g = torch.Generator().manual_seed(m)
        x, y = torch.randn(m * mb, dim, generator=g), torch.randn(m * mb, dim, generator=g)
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < K:
                continue  # 1F1B needs at least K micro-batches
            runtime = PipelineRuntime(
                blocks, counts=[2, 2], schedule=schedule, microbatches=m, loss_fn=_loss, group=group, device=device
            )
            out[f"bubble_{schedule}_M{m}"] = median(_steps(runtime, x, y, reps)["bubble"])
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
    # balance="time" vs balance="params" on an unbalanced model, the strategy's own partitioners
    m, dim = 8, dim // 2  # the heavy blocks are 8x a balanced block: halve the width (1/4 the FLOPs)
    blocks = unbalanced_blocks(dim)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * mb, dim, generator=g), torch.randn(m * mb, dim, generator=g)
    seconds = torch.tensor(profile_blocks(blocks, x[:mb]), dtype=torch.float64)
    dist.all_reduce(seconds)
    splits = {
        "params": partition_blocks([sum(p.numel() for p in b.parameters()) for b in blocks], K),
        "time": partition_blocks((seconds / world).tolist(), K),
    }
    runtimes = {
        name: PipelineRuntime(
            blocks, counts=counts, schedule="1f1b", microbatches=m, loss_fn=_loss, group=group, device=device
        )
        for name, counts in splits.items()
    }
    walls: dict[str, list[float]] = {name: [] for name in splits}
    busiest: dict[str, list[float]] = {name: [] for name in splits}
    for _ in range(reps):  # interleaved, so both see the same machine load
        for name, runtime in runtimes.items():
            result = _steps(runtime, x, y, 1)
            walls[name] += result["wall"]
            busiest[name] += result["max_busy"]
    out["balance_split_params"], out["balance_split_time"] = splits["params"], splits["time"]
    out["balance_time_over_params"] = median([t / p for t, p in zip(walls["time"], walls["params"], strict=True)])
    out["balance_busiest_stage"] = median(
        [t / p for t, p in zip(busiest["time"], busiest["params"], strict=True)]
    )
    return out


def run_world(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """K forked processes with a gloo group; rank 0's results (killed past ``timeout``)."""
    return dict(run_workers(_measure, K, cfg, timeout=timeout)[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 repetitions, smaller blocks (CI smoke run)")
    # ~20 ms of compute per micro-batch and stage, so transfers (~0.2 ms) and Python overhead
    # between chunks (~1 ms on a loaded 2-core machine) are small next to it
    parser.add_argument("--dim", type=int, default=1024, help="width of the synthetic blocks")
    parser.add_argument("--microbatch", type=int, default=64, help="samples per micro-batch")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per setting (median)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if args.quick:
        args.dim, args.microbatch, args.reps = 512, 32, 2
    print(header(f"pipeline: K={K} CPU processes (gloo, 1 thread each), blocks {args.dim} wide"), flush=True)
    cfg = {"dim": args.dim, "microbatch": args.microbatch, "reps": args.reps}
    r = run_world(cfg, args.timeout)
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            key = f"bubble_{schedule}_M{m}"
            if key in r:
                line(f"bubble_over_theory_{schedule}_M{m}", r[key] / ((K - 1) / (m + K - 1)), "x")
    for schedule in ("gpipe", "1f1b"):
        for m in MICROBATCHES:
            key = f"bubble_{schedule}_M{m}"
            if key in r:
                line(key, r[key], "fraction")
    for m in MICROBATCHES:
        if f"peak_1f1b_M{m}" in r:
            line(f"peak_activation_1f1b_over_gpipe_M{m}", r[f"peak_1f1b_M{m}"] / r[f"peak_gpipe_M{m}"], "x")
            line(f"peak_activation_theory_M{m}", K / m, "x")
    line("balance_time_over_params", r["balance_time_over_params"], "x")
    # the slowest stage's compute per step, time / params: what balancing changes, whatever
    # the machine's parallelism (the step time follows it only as far as the stages overlap)
    line("balance_busiest_stage_time_over_params", r["balance_busiest_stage"], "x")
    # what the bubble is made of besides the schedule: per-stage compute of one micro-batch
    # (forward + backward) and one transfer's latency on this machine, measured in the same run
    line("compute_ms_per_microbatch_stage", r["compute_ms"], "ms")
    line("p2p_one_way_ms", r["p2p_ms"], "ms")
    line("cpu_parallel_efficiency", r["parallel_efficiency"], "x")
    print(f"# blocks per stage: params {r['balance_split_params']}, time {r['balance_split_time']}", flush=True)
    if not args.quick:
        plot_bubble(r, Path(__file__).parent / "results" / "pipeline.png")
    return 0


def plot_bubble(r: dict[str, Any], path: Path) -> None:
    """The seed's claim 5: the measured bubble against (K-1)/(M+K-1), per schedule."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s")):
        ms = [m for m in MICROBATCHES if f"bubble_{schedule}_M{m}" in r]
        ax.plot(ms, [r[f"bubble_{schedule}_M{m}"] for m in ms], marker + "-", label=f"{schedule} (measured)")
    ax.plot(MICROBATCHES, [(K - 1) / (m + K - 1) for m in MICROBATCHES], "k--", label="(K-1)/(M+K-1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("bubble (idle share of a step)")
    ax.set_title(f"pipeline bubble, K={K} stages (CPU parallel efficiency {r['parallel_efficiency']:.2f})")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
