"""Where a tensor-parallel step's time goes on this machine: DTensor's host work per split layer (#30).

The advisor under-predicted every tensor cell of its validation (0.09-0.38, each below the measured
step). Two costs were missing from its model, and this script measures the first and checks both:

- **DTensor's dispatch.** ``TensorParallelStrategy`` splits the planned layers into ``DTensor``s;
  each op on them goes through DTensor's sharding propagation on the host, in the forward, the
  backward and the optimizer step. Timed here in one process on a one-process mesh (a gloo group of
  1: no peer, no transfer), the emulated cluster's MLP (``_fit.py``: 3 linear layers, all split)
  at the per-device batch of 32, whole against split, taking turns step by step. At T processes a rank's
  activations of a split layer hold T x 32 rows of 1/T of the width: as many elements as one process
  at 32 rows holds whole, so the T = 1 figure stands for every T. The preset's
  ``tensor_overhead_us`` is ``tensor_cpu_dtensor_us_per_layer``.
- **The gradients left whole.** A row-split layer's bias (and any layer the plan leaves whole) is the
  same on every rank of a group; the strategy all-reduces those gradients over every process each
  step (``TensorParallelStrategy._average_gradients``): one more collective, its latency on the
  critical path. The model now has it (``Measurement.tensor_replicated_bytes``).

Then the tensor fit of ``advisor_cluster.py`` runs on loopback at T = P = 2 and 4 (``_fit.py``, batch 32
x P, ``torchrun --standalone``), next to ddp's fit of the same MLP (the loopback presets' accuracy on a
strategy the model already gets right), and the advisor predicts each: with this machine's figure for
the dispatch and without both new terms (the model as it was).

Lines:

    tensor_cpu_plain_ms_<phase>, tensor_cpu_split_ms_<phase>   forward / backward / optimizer step of the MLP
                                                 whole and split over a one-process mesh (medians)
    tensor_cpu_dtensor_us_per_layer              split step less whole step (median over the steps, the two
                                                 taking turns), per split layer
    tensor_cpu_wall_s_per_step_<s>_P<P>          the fit's wall time per step (ddp, tensor)
    tensor_cpu_predicted_over_wall_<s>_P<P>      the advisor's step over it (the 2x2 preset's host
                                                 figures on one node of P; tensor with the dispatch
                                                 measured here)
    tensor_cpu_predicted_over_wall_tensor_P<P>_before   the same without the dispatch and the whole
                                                 gradients' all-reduce (the model before this change)
    tensor_cpu_main_s_per_step_<s>_P<P>          the main thread's CPU per step, median over ranks

    python benchmarks/tensor_cpu.py              # 2 rounds (~2 min); writes results/tensor_cpu.txt
    python benchmarks/tensor_cpu.py --quick      # P = 2, 1 round, 8 steps; writes nothing
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_average, load_line, median
from benchmarks._rank_cpu import PRESET, finish, loopback, parse_fit_args, run_fit, split_cpu, wall_per_step
from benchmarks.emulated._fit import IN, MLP, OUT
from lightning_strategies.advisor import measure
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.measure import Measurement
from lightning_strategies.advisor.model import predict
from lightning_strategies.comm.tensor import auto_plan, parallelize

PHASES = ("forward", "backward", "optimizer")
STRATEGIES = ("ddp", "tensor")


def _phases(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, ...]:
    """Seconds of each phase (``PHASES``) of one SGD step of ``net`` (as ``_fit.py``'s)."""
    t0 = time.perf_counter()
    loss = nn.functional.mse_loss(net(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def dispatch(rounds: int, steps: int) -> tuple[dict[str, float], dict[str, float], float, int]:
    """Per phase, the median seconds of the MLP whole and split over a one-process mesh; the median over steps
    of the split step's seconds less the whole one's; and the split layers. The two models take turns step by
    step (which goes first alternates), so a slower minute on a shared machine slows both alike; the first 3
    steps of each round are untimed. Runs in a gloo group of one process (an in-memory store), destroyed after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        net = MLP(1024, 2).net
        plan = auto_plan(net)
        x, y = torch.randn(32, IN), torch.randn(32, OUT)
        got: dict[str, list[tuple[float, ...]]] = {"plain": [], "split": []}
        for _ in range(rounds):
            split = copy.deepcopy(net)
            parallelize(split, mesh, plan)
            models = {"plain": copy.deepcopy(net), "split": split}
            opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
            for i in range(steps + 3):
                for kind in ("plain", "split") if i % 2 == 0 else ("split", "plain"):
                    phases = _phases(models[kind], opts[kind], x, y)
                    if i >= 3:
                        got[kind].append(phases)
    finally:
        dist.destroy_process_group()
    plain, split_s = ({p: median([t[j] for t in got[k]]) for j, p in enumerate(PHASES)} for k in ("plain", "split"))
    extra = median([sum(s) - sum(w) for s, w in zip(got["split"], got["plain"], strict=True)])
    return plain, split_s, extra, len(plan)


def predicted(m: Measurement, strategy: str, world: int, *, layer_s: float, before: bool = False) -> float:
    """The advisor's step on loopback (``_rank_cpu.loopback``); ``before``: without the dispatch and the whole
    gradients' all-reduce."""
    costs = loopback(world).costs(m.step_s).with_(tensor_layer_s=0.0 if before else layer_s)
    work = strategy_workload(m, strategy, 32, tp_size=world if strategy == "tensor" else 1)
    if before:
        work = dataclasses.replace(work, tensor_replicated_bytes=None, tensor_layers=0)
    return predict(strategy, costs, world, work).step_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    args = parse_fit_args(parser, argv, steps=40)
    text = [header("tensor_cpu: DTensor's host work per split layer, and the tensor fit against the advisor")]
    text.append(load_line("start"))
    text.append(f"# fits: _fit.py MLP, T = P, batch 32 x P (ddp: 32 per process); {args.steps} steps, {args.warmup} "
                f"untimed; model: preset {PRESET} on 1 node of P; {args.rounds} round(s), interleaved")  # fmt: skip
    print("\n".join(text), flush=True)
    fits: dict[tuple[str, int], list[list[dict]]] = {}
    for r in range(args.rounds):
        order = [(s, w) for w in args.worlds for s in STRATEGIES]
        for strategy, world in order if r % 2 == 0 else reversed(order):
            fits.setdefault((strategy, world), []).append(run_fit(strategy, world, args.steps, args.warmup, 600.0))
            text.append(f"# round {r} {strategy} P={world}: {1e3 * wall_per_step(fits[strategy, world][-1]):.1f} ms "
                        f"wall/step (load {load_average()})")  # fmt: skip
            print(text[-1], flush=True)
    torch.set_num_threads(1)  # after the fits' forks: as every rank of them, one thread
    plain, split, extra_s, layers = dispatch(2 if args.quick else 5, 20 if args.quick else 60)
    for p in PHASES:
        text.append(line(f"tensor_cpu_plain_ms_{p}", 1e3 * plain[p], "ms"))
        text.append(line(f"tensor_cpu_split_ms_{p}", 1e3 * split[p], "ms"))
    layer_s = extra_s / layers
    text.append(line("tensor_cpu_split_layers", layers, "layers"))
    text.append(line("tensor_cpu_dtensor_us_per_layer", 1e6 * layer_s, "us"))
    m = measure(MLP(1024, 2), (torch.randn(32, IN), torch.randn(32, OUT)), repeats=5)
    text.append(line("tensor_cpu_replicated_bytes", m.tensor_replicated_bytes, "bytes"))
    for (strategy, world), runs in fits.items():
        tag = f"{strategy}_P{world}"
        wall = median([wall_per_step(run) for run in runs])
        text.append(line(f"tensor_cpu_wall_s_per_step_{tag}", wall, "s"))
        text.append(line(f"tensor_cpu_predicted_over_wall_{tag}", predicted(m, strategy, world, layer_s=layer_s) / wall,
                         "x"))  # fmt: skip
        if strategy == "tensor":
            before = predicted(m, strategy, world, layer_s=layer_s, before=True)
            text.append(line(f"tensor_cpu_predicted_over_wall_{tag}_before", before / wall, "x"))
        main_s = median([split_cpu(rec)[0] for run in runs for rec in run])
        text.append(line(f"tensor_cpu_main_s_per_step_{tag}", main_s, "cpu_s"))
    return finish(text, "tensor_cpu", args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
