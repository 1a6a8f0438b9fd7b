"""The advisor's memory per device against real fits: each strategy's ranks, by the tensors each held
before its optimizer steps and at the end of training (``_rank_memory.RankMemory``, as
``pipeline_memory.py`` measures).

Models: the digits ResNet (``recipes/models.py`` resnet18, small stem, width 16, 1 x 32 x 32) and the
wide MLP (1 x 8 x 8 -> 1024 -> 1024 -> 1024 -> 10), in the recipes' ``ClassificationModule`` with
SGD + momentum (one state tensor per parameter). Each fit: 2 steps on random data, every rank a
fork-started CPU process (gloo, one torch thread). Per device ``BATCH`` samples: a pipeline replica
of K stages takes K x ``BATCH`` in 2K micro-batches, a tensor-parallel group T x ``BATCH``.

Each fit meets on a port of its own, below the kernel's ephemeral range (``_workers.reserved_port``).
Lightning would reuse the first fit's ``MASTER_PORT`` (a ``bind(0)`` port it leaves in ``os.environ``)
for every later fit, a minute on, when the kernel may have handed that port out again as the local
end of another connection. (A process per fit, forked from this one, is refused by Lightning: this
process's device query marks its forks as "bad CUDA forks", and a spawned one imports for seconds.)
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._rank_memory import RankMemory
from benchmarks._workers import reserved_port
from lightning_strategies import ParameterServerStrategy, PipelineStrategy, TensorParallelStrategy
from lightning_strategies.advisor import measure
from lightning_strategies.advisor.memory import Memory, memory, pipeline_memory
from recipes.classification import ClassificationModule
from recipes.models import build_model

BATCH = 16
STEPS = 2
CLASSES = 10
# (model name, build_model's arguments, image side); --quick: narrower
Spec = tuple[str, dict[str, Any], int]
MODELS: dict[str, Spec] = {
    "resnet": ("resnet18", {"stem": "small", "width": 16}, 32),
    "wide_mlp": ("wide_mlp", {"width": 1024}, 8),
}
QUICK: dict[str, Spec] = {
    "resnet": ("resnet18", {"stem": "small", "width": 8}, 16),
    "wide_mlp": ("wide_mlp", {"width": 256}, 8),
}
# (tag, strategy, processes)
CONFIGS = (("ddp", "ddp", 2), ("ps", "ps", 2), ("pipeline_K2", "pipeline", 2), ("pipeline_K4", "pipeline", 4),
           ("tensor_T2", "tensor", 2))  # fmt: skip


def state(mem: Memory) -> float:
    """What tensor accounting before an optimizer step sees: parameters (and buffers), gradients, optimizer state."""
    return mem.params + mem.grads + mem.optimizer


@dataclass(frozen=True)
class Row:
    """One model x configuration: the advisor's memory of each rank (a pipeline's stage s on rank s)
    and what each rank held (``RankMemory``'s rows)."""

    model: str
    config: str
    predicted: list[Memory]
    ranks: list[dict[str, float]]

    @property
    def errors(self) -> list[float]:
        return [abs(state(p) - r["tensor_mib"] * 2**20) / (r["tensor_mib"] * 2**20)
                for p, r in zip(self.predicted, self.ranks, strict=True)]  # fmt: skip

    @property
    def error(self) -> float:
        return max(self.errors)


def _optimizer() -> Any:
    return functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4)


def _module(spec: Spec) -> ClassificationModule:
    torch.manual_seed(0)
    name, kwargs, _ = spec
    net = build_model(name, num_classes=CLASSES, in_channels=1, **kwargs)
    return ClassificationModule(net, num_classes=CLASSES, optimizer=_optimizer())


def _batch(spec: Spec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    side = spec[2]
    return torch.randn(n, 1, side, side, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def _strategy(strategy: str, world: int) -> tuple[Any, int, dict[str, Any]]:
    """The strategy, its loader batch, and the advisor's options for it."""
    if strategy == "ddp":
        return "ddp_fork", BATCH, {}
    if strategy == "ps":
        return ParameterServerStrategy(start_method="fork"), BATCH, {}
    if strategy == "pipeline":
        s = PipelineStrategy(num_stages=world, microbatches=2 * world, start_method="fork")
        return s, world * BATCH, {"stages": world, "microbatches": 2 * world}
    return TensorParallelStrategy(tp_size=world, start_method="fork"), world * BATCH, {"tp_size": world}


def _fit(spec: Spec, strategy: str, world: int, out: Path) -> None:
    built, loader_batch, _ = _strategy(strategy, world)
    x, y = _batch(spec, loader_batch * STEPS * (1 if strategy in ("pipeline", "tensor") else world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(reserved_port()))  # the Trainer's port (module doc)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=built, max_steps=STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[RankMemory(out)],
    )  # fmt: skip
    trainer.fit(_module(spec), DataLoader(TensorDataset(x, y), batch_size=loader_batch))


def run(quick: bool) -> list[Row]:
    """Every model x configuration: fitted (first, before this process runs autograd), then predicted."""
    models = QUICK if quick else MODELS
    fitted: dict[tuple[str, str], list[dict[str, float]]] = {}
    for model, spec in models.items():
        for tag, strategy, world in CONFIGS:
            with tempfile.TemporaryDirectory() as tmp:
                _fit(spec, strategy, world, Path(tmp))
                fitted[model, tag] = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for model, spec in models.items():
        module = _module(spec)
        m = measure(module, _batch(spec, BATCH), optimizer=lambda p: _optimizer()(p), repeats=1)
        for tag, strategy, world in CONFIGS:
            options = _strategy(strategy, world)[2]
            if strategy == "pipeline":
                pred = pipeline_memory(m, batch=BATCH, stages=world, microbatches=options["microbatches"])
            else:
                pred = [memory(strategy, m, batch=BATCH, world=world, **options)] * world
            rows.append(Row(model, tag, pred, fitted[model, tag]))
    return rows
