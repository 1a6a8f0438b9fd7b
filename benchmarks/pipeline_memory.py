"""Pipeline memory per rank: one process against K = 2 and 4 stages, a wide MLP on CPU processes.

A stack of ``layers`` fully connected ``width x width`` layers (the default 8 x 2048 holds 33.6M
weights, 134 MB in float32; a batch of 16 makes its activations ~1 MB) is built in
``configure_model`` and trained for a few steps with SGD + momentum, either whole in one process
(``strategy="auto"``) or by ``PipelineStrategy`` with K stages on K fork-started processes (gloo,
one torch thread each; 1F1B, 2K micro-batches). Under the pipeline ``configure_model`` builds on
``meta`` and rank 0 materialises one block at a time, so a rank holds its stages' weights,
gradients and momentum and, at setup, one block in transit.

Per process, ``_rank_memory.RankMemory`` reads the peak RSS over its baseline at ``setup`` and the
tensor-accounted bytes (parameters + gradients + optimizer state of this rank) at the end of
training; glibc's allocator maps every allocation of 1 MiB or more on its own, so freed weights
return to the kernel and the peak is what was held at once, not the heap's history.

    single_peak_rss_growth_mib              peak RSS over the baseline, one process
    pipeline_peak_rss_growth_K<k>_rank<r>_mib
    pipeline_peak_rss_over_single_K2        the largest rank's growth / one process's   goal <= 0.60
    pipeline_peak_rss_over_single_K4                                                      goal <= 0.35
    pipeline_tensor_bytes_over_single_K<k>  the largest rank's tensor bytes / one process's (1/K ideally)
    single_tensor_mib / pipeline_tensor_K<k>_rank<r>_mib

Rounds (``--rounds``) run the three configurations in turn; the median of each line is printed.

    python benchmarks/pipeline_memory.py           # 8 x 2048, 3 steps, 2 rounds (~1-2 min on 2 cores)
    python benchmarks/pipeline_memory.py --quick   # 8 x 512, 2 steps, 1 round (seconds, for CI)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._common import header, line, load_line, pyplot, save_figure
from benchmarks._rank_memory import RankMemory, map_large_allocations
from lightning_strategies import PipelineStrategy

RESULTS = Path(__file__).resolve().parent / "results"
GOALS = {2: 0.60, 4: 0.35}


class WideMLP(pl.LightningModule):
    """``layers`` linear layers ``width x width`` (ReLU between), MSE on random targets, SGD + momentum."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width, self.layers = width, layers
        self.net: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            mods: list[nn.Module] = []
            for i in range(self.layers):
                mods.append(nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU()) if i < self.layers - 1
                            else nn.Linear(self.width, self.width))  # fmt: skip
            self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def pipeline_layers(self) -> nn.Sequential:
        assert self.net is not None
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _fit(stages: int, width: int, layers: int, steps: int, out: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16 * steps, width, generator=g), torch.randn(16 * steps, width, generator=g))
    strategy: Any = "auto" if stages == 1 else PipelineStrategy(microbatches=2 * stages, start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=max(1, stages), strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[RankMemory(out)],
    )  # fmt: skip
    trainer.fit(WideMLP(width, layers), DataLoader(data, batch_size=16))


def _run(stages: int, width: int, layers: int, steps: int) -> list[dict[str, float]]:
    """One configuration; every rank in a fresh fork-started process: the pipeline's ranks by
    Lightning's fork launcher from this process, the single run in a child of its own (a process
    forked from this one may not fork ranks itself: Lightning refuses once torch marked it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if stages > 1:
            _fit(stages, width, layers, steps, out)
        else:
            proc = mp.get_context("fork").Process(target=_fit, args=(stages, width, layers, steps, out))
            proc.start()
            proc.join(timeout=900)
            if proc.exitcode != 0:
                raise RuntimeError(f"the single-process run exited with {proc.exitcode}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(stages)]


def plot(rows: dict[int, list[dict[str, float]]], path: Path) -> None:
    plt = pyplot()
    single = rows[1][0]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ks = sorted(rows)
    ax.plot(ks, [1 / k for k in ks], "k--", label="1/K (ideal)")
    for k in ks:
        peaks = [r["growth_mib"] / single["growth_mib"] for r in rows[k]]
        tensors = [r["tensor_mib"] / single["tensor_mib"] for r in rows[k]]
        ax.scatter([k] * len(peaks), peaks, color="tab:blue", label="peak RSS growth per rank" if k == ks[0] else None)
        ax.scatter([k] * len(tensors), tensors, color="tab:orange", marker="x",
                   label="params + grads + momentum per rank" if k == ks[0] else None)  # fmt: skip
    for k, goal in GOALS.items():
        ax.plot([k - 0.15, k + 0.15], [goal, goal], color="tab:red", lw=1)
    ax.set_xticks(ks)
    ax.set_xlabel("pipeline stages K (processes)")
    ax.set_ylabel("memory per rank / one process")
    ax.set_title("Pipeline memory per rank (red: goals)")
    ax.set_ylim(0, 1.1)
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 x 512, 2 steps, 1 round (CI)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.width, args.steps, args.rounds = 512, 2, 1
    torch.set_num_threads(1)
    map_large_allocations()
    print(header(f"pipeline_memory {args.layers} x {args.width}, batch 16, {args.steps} steps"), flush=True)
    print(load_line("start"), flush=True)
    goals = ", ".join(f"pipeline_peak_rss_over_single_K{k} <= {g:.2f}" for k, g in GOALS.items())
    print(f"# goals: {goals}", flush=True)
    runs: dict[int, list[list[dict[str, float]]]] = {1: [], 2: [], 4: []}
    for _ in range(args.rounds):
        for k in runs:
            runs[k].append(_run(k, args.width, args.layers, args.steps))
    rows = {
        k: [{key: statistics.median(rounds[i][r][key] for i in range(len(rounds))) for key in rounds[0][r]}
            for r in range(k)]
        for k, rounds in runs.items()
    }  # fmt: skip
    single = rows[1][0]
    line("single_peak_rss_growth_mib", single["growth_mib"], "MiB")
    line("single_tensor_mib", single["tensor_mib"], "MiB")
    for k in (2, 4):
        for r, row in enumerate(rows[k]):
            line(f"pipeline_peak_rss_growth_K{k}_rank{r}_mib", row["growth_mib"], "MiB")
            line(f"pipeline_tensor_K{k}_rank{r}_mib", row["tensor_mib"], "MiB")
        peak, tensors = max(r["growth_mib"] for r in rows[k]), max(r["tensor_mib"] for r in rows[k])
        line(f"pipeline_peak_rss_over_single_K{k}", peak / single["growth_mib"], "x")
        line(f"pipeline_tensor_bytes_over_single_K{k}", tensors / single["tensor_mib"], "x")
    print(load_line("end"), flush=True)
    if not args.quick:
        plot(rows, RESULTS / "pipeline_memory.png")


if __name__ == "__main__":
    main()
