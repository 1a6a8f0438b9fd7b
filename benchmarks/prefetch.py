"""Does prefetching hide loading cost? Step time with and without DataLoader prefetching.

A dataset sleeps ``load_ms`` per sample (simulated reading/decoding, no CPU used) and a small
CNN takes a training step of comparable cost. Without prefetching (``num_workers=0``) a step
costs load + compute; with one worker preparing batches ahead it should cost
max(load, compute), load and compute each measured alone in the same rounds. Runs them
interleaved, several rounds, and prints medians and
``prefetch_over_ideal`` = prefetched step / max(load, compute) (goal <= 1.10 when balanced).

    python benchmarks/prefetch.py            # load = 0.5x, 1x, 2x compute, plot into benchmarks/results/
    python benchmarks/prefetch.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, pyplot, save_figure
from lightning_strategies.data import PrefetchConfig
from recipes.data import SyntheticImages
from recipes.models import build_model


def _step_fn(batch_size: int, image_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model("small_cnn", num_classes=10, in_channels=3, width=16)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train_steps(loader: DataLoader, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    """Seconds per step over ``steps`` steps, after one warm-up step (worker start-up excluded)."""
    it = iter(loader)
    times = []
    start = time.perf_counter()
    for i in range(steps + 1):
        x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if i > 0:
            times.append(now - start)
        start = now
    return median(times)


def measure_compute(batch_size: int, image_size: int, reps: int = 15) -> float:
    model, opt = _step_fn(batch_size, image_size)
    x, y = torch.randn(batch_size, 3, image_size, image_size), torch.randint(0, 10, (batch_size,))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return median(times[3:])


def run(
    load_ratio: float, compute_s: float, *, batch_size: int, image_size: int, steps: int, rounds: int
) -> dict[str, float]:
    """Median step time of three loaders, interleaved per round: data already in memory
    (compute only, measured here rather than assumed), loading in series, loading prefetched."""
    n = batch_size * (steps + 2) * 2
    in_memory = SyntheticImages(n, image_size=image_size)
    # Making the images costs the loader time of its own: sleep only for the rest of the target.
    overhead_s = _load_steps(DataLoader(in_memory, batch_size=batch_size), steps)
    load_ms = 1000 * max(0.0, load_ratio * compute_s - overhead_s) / batch_size
    data = SyntheticImages(n, image_size=image_size, load_ms=load_ms)
    x = torch.stack([in_memory[i][0] for i in range(n)])
    y = torch.stack([in_memory[i][1] for i in range(n)])
    loaders = {
        "compute": lambda: DataLoader(TensorDataset(x, y), batch_size=batch_size),
        "none": lambda: DataLoader(data, batch_size=batch_size, **PrefetchConfig(num_workers=0).loader_kwargs()),
        "prefetch": lambda: DataLoader(
            data, batch_size=batch_size, **PrefetchConfig(num_workers=1, prefetch_factor=2).loader_kwargs()
        ),
    }
    results: dict[str, list[float]] = {k: [] for k in ("load", *loaders)}
    for _ in range(rounds):
        # load only: what one batch really costs the loader (the sleep plus making the images)
        results["load"].append(_load_steps(loaders["none"](), steps))
        for name, make_loader in loaders.items():  # interleaved, so machine noise hits all alike
            model, opt = _step_fn(batch_size, image_size)
            results[name].append(_train_steps(make_loader(), model, opt, steps))
    return {"load_s": load_ms * batch_size / 1000, **{k: median(v) for k, v in results.items()}}


def _load_steps(loader: DataLoader, steps: int) -> float:
    it = iter(loader)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - t)
    return median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one load ratio, few steps (CI)")
    parser.add_argument("--ratios", default="0.5,1,2", help="load cost as multiples of compute")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "results" / "prefetch.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        # three interleaved rounds, medians: one round's ratio moved 0.75-1.7 under load (a burst
        # during the "ideal" loaders alone); a few seconds more
        args.ratios, args.steps, args.rounds, args.plot = "1", 8, 3, None
    print(header("prefetch: step time vs simulated loading cost"))
    print(load_line("start"), flush=True)
    compute_s = measure_compute(args.batch_size, args.image_size)
    line("calibration_compute_step_ms", 1000 * compute_s, "ms")
    rows = []
    for ratio in (float(r) for r in args.ratios.split(",")):
        r = run(ratio, compute_s, batch_size=args.batch_size, image_size=args.image_size, steps=args.steps,
                rounds=args.rounds)
        ideal = max(r["load"], r["compute"])
        tag = f"load{ratio:g}x"
        line(f"{tag}_simulated_load_ms", 1000 * r["load_s"], "ms")
        line(f"{tag}_load_step_ms", 1000 * r["load"], "ms")
        line(f"{tag}_compute_step_ms", 1000 * r["compute"], "ms")
        line(f"{tag}_no_prefetch_step_ms", 1000 * r["none"], "ms")
        line(f"{tag}_prefetch_step_ms", 1000 * r["prefetch"], "ms")
        line(f"{tag}_ideal_step_ms", 1000 * ideal, "ms")
        line(f"{tag}_no_prefetch_over_ideal", r["none"] / ideal, "x")
        line(f"{tag}_prefetch_over_ideal", r["prefetch"] / ideal, "x")
        rows.append((ratio, r, ideal))
    if args.plot is not None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(5, 3.4))
        loads = [1000 * r["load"] for _, r, _ in rows]
        ax.plot(loads, [1000 * r["none"] for _, r, _ in rows], "o-", label="no prefetch (num_workers=0)")
        ax.plot(loads, [1000 * r["prefetch"] for _, r, _ in rows], "s-", label="prefetch (1 worker, factor 2)")
        ax.plot(loads, [1000 * i for _, _, i in rows], "k--", label="max(load, compute)")
        ax.plot(loads, [1000 * (r["load"] + r["compute"]) for _, r, _ in rows], "k:", label="load + compute")
        ax.set_xlabel("load per batch, measured alone (ms)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"I/O overlap (compute {1000 * compute_s:.0f} ms/step)")
        ax.legend(fontsize=8)
        save_figure(fig, args.plot)
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
