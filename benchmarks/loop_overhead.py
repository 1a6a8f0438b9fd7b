"""The training loop's host work per step: a Lightning step on one process against its forward, backward and
optimizer step alone (what the advisor charges as ``loop_us``, ``conf/cluster/*.yaml``).

A Lightning step is more than the model's arithmetic: the training step runs through the loop's closure,
hooks and the precision plugin, the optimizer is called through Lightning's wrappers, and the next batch is
fetched and collated between steps. The advisor measures the forward, backward and optimizer step of the
user's module (``advisor.measure``) and charges the rest per step and process as ``loop_us``.

Each round fits one process (``Trainer(accelerator="cpu", devices=1)``, one torch thread, an in-memory
``TensorDataset`` at batch ``--batch``) and measures the same module with ``advisor.measure`` right before, for
two modules in turn:

    tiny   a 16 -> 16 linear layer: nearly nothing but the loop (its figure is the presets' ``loop_us``)
    mlp    the emulated runs' MLP (``benchmarks/emulated/_fit.py``, 1.31 M parameters)

A step's wall time is the median time between consecutive ``on_train_batch_start`` calls over the timed steps.
Prints a header (machine, versions, date, load), then ``name value unit`` lines:

    loop_overhead_us_<model>              a Lightning step - (forward + backward + optimizer step), median of rounds
                                          (printed as measured: negative where the CPU was slower while measuring
                                          than while fitting; the prediction below then takes a loop of 0)
    loop_overhead_us_<model>_spread       (max - min) / median over the rounds
    loop_lightning_step_ms_<model>        the Lightning step's wall time
    loop_measured_step_ms_<model>         advisor.measure's forward + backward, and its optimizer step (next line)
    loop_measured_optimizer_ms_<model>
    loop_advisor_step_error_mlp_P1        the advisor's one-process step for the MLP, with the tiny module's
                                          loop_us, against the Lightning step (|predicted - measured| / measured)
    loop_advisor_step_error_mlp_P1_without_loop    the same from forward + backward alone (the advisor before the
                                          loop's phase, which adds the loop and the optimizer step)

    python benchmarks/loop_overhead.py            # 9 rounds (~30 s)
    python benchmarks/loop_overhead.py --quick    # 1 round, few steps, nothing written (CI)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, spread
from benchmarks.emulated._fit import IN, MLP, OUT
from lightning_strategies.advisor import Measurement, load_cluster, measure
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.model import predict

RESULTS = Path(__file__).resolve().parent / "results"
TINY = 16


class Tiny(pl.LightningModule):
    """One ``TINY -> TINY`` linear layer under an MSE loss and SGD: a step that is nearly all loop."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(TINY, TINY)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepStarts(pl.Callback):
    """``time.perf_counter()`` at every ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())


def modules() -> dict[str, tuple[pl.LightningModule, int, int]]:
    """Each module with its inputs' and targets' features."""
    return {"tiny": (Tiny(), TINY, TINY), "mlp": (MLP(1024, 2), IN, OUT)}


def lightning_step_s(
    module: pl.LightningModule, features: tuple[int, int], batch: int, steps: int, warmup: int
) -> float:
    """The median wall time between consecutive step starts of a one-process fit, ``warmup`` steps left out."""
    g = torch.Generator().manual_seed(0)
    n = batch * (steps + 1)
    data = TensorDataset(torch.randn(n, features[0], generator=g), torch.randn(n, features[1], generator=g))
    starts = StepStarts()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[starts])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's worker count: the in-memory set needs none
        trainer.fit(module, DataLoader(data, batch_size=batch, drop_last=True))
    gaps = [b - a for a, b in zip(starts.starts[warmup:], starts.starts[warmup + 1 :], strict=False)]
    if len(gaps) < 3:
        raise RuntimeError(f"found {len(gaps)} timed steps of {steps}: expected at least 3 (steps > warmup + 3)")
    return median(gaps)


def one_round(batch: int, steps: int, warmup: int, repeats: int) -> dict[str, tuple[float, Measurement]]:
    """Per module: its Lightning step's seconds and its measurement, the measurement right before the fit."""
    out: dict[str, tuple[float, Measurement]] = {}
    for name, (module, fin, fout) in modules().items():
        sample = (torch.randn(batch, fin), torch.randn(batch, fout))
        m = measure(module, sample, repeats=repeats)
        out[name] = (lightning_step_s(module, (fin, fout), batch, steps, warmup), m)
    return out


def predicted_p1(m: Measurement, loop_us: float, batch: int) -> float:
    """The advisor's step of ``m`` on one process of this machine (``conf/cluster/loopback.yaml``) at ``loop_us``."""
    cluster = load_cluster("loopback", per_node=1, loop_us=loop_us)
    work = strategy_workload(m, "ddp", batch)
    return predict("ddp", cluster.costs(m.step_s), 1, work).step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per fit")
    parser.add_argument("--quick", action="store_true", help="1 round, few steps, nothing written (CI)")
    args = parser.parse_args(argv)
    rounds, steps, warmup, repeats = (1, 12, 4, 5) if args.quick else (args.rounds, args.steps, 10, 15)
    if rounds < 1 or steps < 4:
        parser.error(f"found --rounds {rounds} --steps {steps}: expected rounds >= 1 and steps >= 4")
    torch.set_num_threads(1)
    text = [header("loop_overhead: a Lightning step on one process against advisor.measure's forward, backward "
                   "and optimizer step"), load_line("start")]  # fmt: skip
    print("\n".join(text), flush=True)
    got: dict[str, list[tuple[float, Measurement]]] = {}
    for r in range(rounds):
        for name, value in one_round(args.batch, steps + warmup, warmup, repeats).items():
            got.setdefault(name, []).append(value)
            step, m = value
            text.append(f"# round {r} {name}: Lightning {1e3 * step:.3f} ms, forward + backward "
                        f"{1e3 * m.step_s:.3f} ms, optimizer {1e3 * m.optimizer_s:.3f} ms")  # fmt: skip
            print(text[-1], flush=True)
    loops: dict[str, float] = {}
    for name, values in got.items():
        each = [1e6 * (step - m.step_s - m.optimizer_s) for step, m in values]
        loops[name] = median(each)
        text += [
            line(f"loop_overhead_us_{name}", loops[name], "us"),
            line(f"loop_overhead_us_{name}_spread", spread(each), "x"),
            line(f"loop_lightning_step_ms_{name}", 1e3 * median([s for s, _ in values]), "ms"),
            line(f"loop_measured_step_ms_{name}", 1e3 * median([m.step_s for _, m in values]), "ms"),
            line(f"loop_measured_optimizer_ms_{name}", 1e3 * median([m.optimizer_s for _, m in values]), "ms"),
        ]
    # the MLP predicted on one process with the tiny module's loop (what the presets carry), round by round. A
    # loaded machine can make the measurement slower than the fit after it (a --quick round in a make test run:
    # forward and backward 1.048 ms against 0.12-0.19 quiet, the Lightning step 1.053): the difference is then
    # negative, no loop the advisor can charge (a cluster refuses loop_us < 0), so the prediction takes none
    loop_us = max(0.0, loops["tiny"])
    if loop_us != loops["tiny"]:
        text.append(f"# the tiny module's Lightning step took less than its measured arithmetic "
                    f"({loops['tiny']:.1f} us): the CPU was slower while measuring than while fitting; "
                    "predicted with loop_us = 0")  # fmt: skip
        print(text[-1], flush=True)
    with_loop = [abs(predicted_p1(m, loop_us, args.batch) - s) / s for s, m in got["mlp"]]
    without = [abs(m.step_s - s) / s for s, m in got["mlp"]]  # forward + backward alone: the advisor before
    text += [line("loop_advisor_step_error_mlp_P1", median(with_loop), "x"),
             line("loop_advisor_step_error_mlp_P1_without_loop", median(without), "x"),
             load_line("end")]  # fmt: skip
    print(text[-1], flush=True)
    if not args.quick:
        (RESULTS / "loop_overhead.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
