"""Step time of Lamb and Lars against torch's AdamW and SGD, and foreach vs per-tensor paths.

On the parameter shapes of torchvision ResNet-50 (161 tensors, 25.6M parameters) with random
gradients, one torch thread. The optimizers step *interleaved* (A, B, C, ... A, B, C, ...)
so that drift in the machine's load hits every one alike; medians over the steps after a
warm-up. Prints a header (machine, torch, date), then ``name value unit`` lines:

    lamb_over_adamw          Lamb(foreach) / AdamW(foreach=True)      goal <= 1.3
    lamb_loop_over_foreach   Lamb(foreach=False) / Lamb(foreach=True)  goal >= 1.5
    lars_over_sgd            Lars(foreach) / SGD(momentum=0.9, foreach=True)  goal <= 1.3
    lars_loop_over_foreach   Lars(foreach=False) / Lars(foreach=True)  goal >= 1.5

On CPU the per-tensor loops are memory-bound and keep each tensor in cache across its ops,
so the multi-tensor paths (cache blocked, see ``lightning_strategies/optim/_foreach.py``) win by
saving Python overhead and memory passes only; LARS has too little work per element for 1.5x.

and the raw medians (``lamb_foreach_step_ms``...). ``--quick`` uses ResNet-18 shapes and a
few steps (seconds, for CI).

    python benchmarks/optimizer_step.py            # the full measurement (~30 s on 1 thread)
    python benchmarks/optimizer_step.py --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median
from lightning_strategies.optim import Lamb, Lars

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
    "lamb_foreach": lambda p: Lamb(p, lr=1e-3, weight_decay=0.01, foreach=True),
    "lamb_loop": lambda p: Lamb(p, lr=1e-3, weight_decay=0.01, foreach=False),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
    "lars_foreach": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True),
    "lars_loop": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False),
}


def model_shapes(name: str) -> list[torch.Size]:
    """The parameter shapes of a torchvision model (``resnet50``: 161 tensors, 25.6M)."""
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = getattr(torchvision.models, name)()
    return [p.shape for p in model.parameters()]


def make_params(shapes: Sequence[torch.Size], seed: int) -> list[nn.Parameter]:
    """Random parameters with random gradients (fixed between steps: the step cost is the same)."""
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g) * 0.05) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def measure(shapes: Sequence[torch.Size], steps: int, warmup: int) -> dict[str, float]:
    """Median step time in ms of each optimizer in ``OPTIMIZERS``, stepped interleaved."""
    opts = {name: make(make_params(shapes, seed=i)) for i, (name, make) in enumerate(OPTIMIZERS.items())}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(warmup + steps):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed * 1e3)
    return {name: median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="ResNet-18 shapes, 3 steps (CI smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per optimizer (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if steps < 1 or warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, found {steps} and {warmup}")
    torch.set_num_threads(args.threads)
    model = "resnet18" if args.quick else "resnet50"
    shapes = model_shapes(model)

    print(
        header(
            f"optimizer step: Lamb/Lars vs AdamW/SGD, {model} shapes ({len(shapes)} tensors, "
            f"{sum(s.numel() for s in shapes) / 1e6:.1f}M params), {torch.get_num_threads()} torch thread(s), "
            f"median of {steps} interleaved steps after {warmup} warm-up"
        ),
        flush=True,
    )
    print(load_line("start"), flush=True)
    ms = measure(shapes, steps, warmup)
    for name, value in ms.items():
        line(f"{name}_step_ms", value, "ms")
    line("lamb_over_adamw", ms["lamb_foreach"] / ms["adamw_foreach"], "x")  # goal <= 1.3
    line("lamb_loop_over_foreach", ms["lamb_loop"] / ms["lamb_foreach"], "x")  # goal >= 1.5
    line("lars_over_sgd", ms["lars_foreach"] / ms["sgd_foreach"], "x")  # goal <= 1.3
    line("lars_loop_over_foreach", ms["lars_loop"] / ms["lars_foreach"], "x")  # goal >= 1.5
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
