"""Intra-layer model parallelism: a wide MLP split over 2 processes against the unsplit one.

A stack of ``layers`` fully connected layers ``width x width`` (ReLU between; the default 4 x
4096 holds 67M weights, 268 MB in float32) is trained with SGD + momentum on a batch of random
data, either whole in one process or split by :mod:`lightning_strategies.comm.tensor` over 2
fork-started CPU processes (gloo on 127.0.0.1, one torch thread each): two column/row pairs, so
each rank holds half of every weight matrix. The two run in interleaved rounds in one process
tree; the median step time of each run is taken after warm-up steps. No Lightning here: the
split module and its collectives only (the strategy adds the replicas' gradient averaging,
which a single tensor-parallel group does not need).

    tp_weight_bytes_per_rank_over_single  parameter bytes per rank, tp / single   goal <= 0.55
    tp_state_bytes_per_rank_over_single   params + grads + momentum per rank, tp / single
    tp_rss_over_single                    peak RSS growth per process, tp / single (measured)
    tp_step_over_single                   median step time, tp / single (interleaved rounds)
    tp_activation_bytes_per_step          bytes one rank sends in the activation all-reduces
    tp_activation_bytes_over_formula      counted / formula                          goal 1.00
    tp_allreduce_time_share               seconds inside those all-reduces / step time

The formula (``activation_bytes_per_step``): per column/row pair one forward all-reduce of the
row layer's output and one backward all-reduce of the column layer's input gradient, each
``2 (tp-1)/tp x batch x width x 4`` bytes under a ring (= the payload at tp = 2); the first
layer's input is data (no gradient), so its backward all-reduce does not run and is taken out
of the formula. What is counted is the payload of each collective the split module runs, under
the same ring model: gloo's internal algorithm is not observable from Python (at tp = 2 every
all-reduce algorithm sends the payload once per rank).

Memory is accounted from the tensors (each rank's local parameter, gradient and momentum
bytes); the RSS growth (peak resident set size minus the size before the model was built) is
measured too, and includes activations and allocator slack.

    python benchmarks/tensor_parallel.py           # 4 x 4096, batch 64, 3 rounds (~1-2 min on 2 cores)
    python benchmarks/tensor_parallel.py --quick   # 4 x 512, 1 round (seconds, for CI)
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, pyplot, save_figure
from benchmarks._workers import run_workers
from lightning_strategies.comm.tensor import (
    activation_bytes_per_step,
    auto_plan,
    check_plan,
    local_part,
    parallelize,
    ring_all_reduce_bytes,
)

RESULTS = Path(__file__).resolve().parent / "results"


def wide_mlp(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _measure(rank: int, world: int, width: int, layers: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """One run: ``world`` = 1 (whole) or the tensor-parallel size; returns this rank's figures."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    rss0 = _peak_rss_bytes()
    model = wide_mlp(width, layers)
    tp = None
    if world > 1:
        plan = auto_plan(model)
        check_plan(model, plan, world)
        tp = parallelize(model, init_device_mesh("cpu", (world,)), plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    times: list[float] = []
    for i in range(warmup + steps):
        if i == warmup and tp is not None:
            tp.stats.pop()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    weight = sum(local_part(p).numel() * local_part(p).element_size() for p in params)
    grads = sum(local_part(p.grad).numel() * local_part(p.grad).element_size() for p in params if p.grad is not None)
    state = sum(
        local_part(v).numel() * local_part(v).element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    comm = tp.stats.pop() if tp is not None else None
    return {
        "step_s": median(times[warmup:]),
        "weight_bytes": weight,
        "state_bytes": weight + grads + state,
        "rss_growth": _peak_rss_bytes() - rss0,
        "act_bytes": comm.bytes_sent / steps if comm is not None else 0.0,
        "act_s": comm.seconds / steps if comm is not None else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, one round (CI)")
    args = parser.parse_args()
    width, layers, batch, steps, warmup, rounds = (512, 4, 16, 3, 1, 1) if args.quick else (4096, 4, 64, 5, 2, 3)
    tp = 2
    print(header("tensor_parallel"), flush=True)
    load_start = load_line("start")
    print(load_start, flush=True)
    lines = [line("width", width, "features"), line("layers", layers, "fc"), line("batch", batch, "samples")]
    single_runs, tp_runs = [], []
    for _ in range(rounds):  # interleaved, so a change of machine load hits both alike
        single_runs.append(run_workers(_measure, 1, width, layers, batch, steps, warmup, timeout=600)[0])
        tp_runs.append(run_workers(_measure, tp, width, layers, batch, steps, warmup, timeout=600))
    single_step = median([r["step_s"] for r in single_runs])
    tp_step = median([max(r["step_s"] for r in ranks) for ranks in tp_runs])  # the slower rank sets the pace
    one = single_runs[-1]
    ranks = tp_runs[-1]
    weight_ratio = max(r["weight_bytes"] for r in ranks) / one["weight_bytes"]
    state_ratio = max(r["state_bytes"] for r in ranks) / one["state_bytes"]
    rss_ratio = max(r["rss_growth"] for r in ranks) / max(1, one["rss_growth"])
    act_bytes = median([r["act_bytes"] for ranks_ in tp_runs for r in ranks_])
    model = wide_mlp(width, layers)
    # the first layer's input is data: no gradient, so no backward all-reduce for it
    formula = activation_bytes_per_step(model, auto_plan(model), rows=batch, tp_size=tp) - ring_all_reduce_bytes(
        batch * width * 4, tp
    )
    share = median([max(r["act_s"] for r in ranks_) / max(r["step_s"] for r in ranks_) for ranks_ in tp_runs])
    lines += [
        line("single_step_s", single_step, "s"),
        line("tp_step_s", tp_step, "s"),
        line("tp_step_over_single", tp_step / single_step, "x"),
        line("single_weight_bytes", one["weight_bytes"], "bytes"),
        line("tp_weight_bytes_per_rank", max(r["weight_bytes"] for r in ranks), "bytes"),
        line("tp_weight_bytes_per_rank_over_single", weight_ratio, "x"),
        line("tp_state_bytes_per_rank_over_single", state_ratio, "x"),
        line("single_rss_growth", one["rss_growth"], "bytes"),
        line("tp_rss_growth_per_rank", max(r["rss_growth"] for r in ranks), "bytes"),
        line("tp_rss_over_single", rss_ratio, "x"),
        line("tp_activation_bytes_per_step", act_bytes, "bytes"),
        line("tp_activation_bytes_formula", formula, "bytes"),
        line("tp_activation_bytes_over_formula", act_bytes / formula, "x"),
        line("tp_allreduce_time_share", share, "x"),
    ]
    load_end = load_line("end")
    print(load_end, flush=True)
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = "\n".join([header("tensor_parallel"), load_start, *lines, load_end]) + "\n"
    (RESULTS / "tensor_parallel.txt").write_text(text)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    per_rank = max(r["state_bytes"] for r in ranks)
    axes[0].bar(["single", f"tp={tp} (per rank)"], [one["state_bytes"] / 2**20, per_rank / 2**20])
    axes[0].set_ylabel("MiB (params + grads + momentum)")
    axes[0].set_title("memory per process")
    axes[1].bar(["single", f"tp={tp}"], [single_step * 1e3, tp_step * 1e3])
    axes[1].set_ylabel("ms per step (median)")
    axes[1].set_title(f"step time, {layers} x {width} FC, batch {batch}")
    axes[2].bar(["counted", "formula"], [act_bytes / 2**20, formula / 2**20])
    axes[2].set_ylabel("MiB sent per rank per step")
    axes[2].set_title(f"activation all-reduces ({share:.0%} of the step)")
    save_figure(fig, RESULTS / "tensor_parallel.png")


if __name__ == "__main__":
    main()
