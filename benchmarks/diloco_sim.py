"""DiLoCo against DDP on the digits app, simulated in one process: validation accuracy per outer step.

Why ``benchmarks/cluster_diloco.py``'s DiLoCo stalled below DDP, found without the cluster. Two
replicas train in this one process, each on its ``DistributedSampler`` shard of the digits app's
training split (the ``digits_resnet`` recipe: width-16 ResNet-18, 64 samples per replica and step,
the recipe's linear scaling, 1-step warmup and cosine decay to 0 at ``--steps``, norm and bias
parameters without weight decay), exactly as the 2-node cluster run feeds them:

    ddp     one model; each step the mean of both replicas' gradients (each replica's BatchNorm on its
            own 64 samples), SGD lr 0.05 per 64 scaled (0.1), momentum 0.9, weight decay 5e-4; BN
            running statistics rank 0's (DDP broadcasts rank 0's buffers every forward)
    diloco  two models; H inner steps each on its own shard, then the library's
            :class:`~lightning_strategies.comm.ft.OuterLoop` (the mean pseudo-gradient, Nesterov outer SGD)
            with the buffers ``local`` (each replica keeps its own: what the library did before
            ``sync_buffers``) or ``mean`` (floating buffers averaged at every sync: the library's default now)

Validation: replica 0's model (after the sync, the global weights) on the 270-image validation split
every H steps (ddp: every H steps too), the split ``cluster_diloco.py`` validates on. Variants are
named on the command line:

    python benchmarks/diloco_sim.py                     # every variant, in turn -> results/diloco_sim.txt
    python benchmarks/diloco_sim.py --only ddp diloco   # some of them, printed only
    python benchmarks/diloco_sim.py --quick             # ddp and diloco for 4 steps, H = 2, printed only (CI)

Lines: ``sim_val_acc_<variant> <acc at --steps> x`` and a comment per variant with every validation.
A variant takes 2-14 minutes on the loaded 2-core machine; the stored ``results/diloco_sim.txt`` is
the outputs of ``--only`` runs, 2-4 at a time, one after the other (each with its own header and load).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DistributedSampler, TensorDataset

from benchmarks._common import header, load_line
from benchmarks._common import line as emit
from lightning_strategies import ScalingConfig
from lightning_strategies.comm.ft import OuterLoop, average_buffers
from lightning_strategies.optim import param_groups
from recipes.data import DigitsDataModule
from recipes.models import build_model

RESULTS = Path(__file__).parent / "results"
SEED = 0


@dataclass(frozen=True)
class Variant:
    """One training setting.

    Attributes:
        strategy: ``ddp`` or ``diloco``.
        inner: ``adamw`` (lr 1e-3 per 64, weight decay 0.05: cluster_diloco's) or ``sgd`` (DDP's).
        inner_lr: base lr per 64 samples (scaled linearly); ``None``: the optimizer's default above.
        outer_lr, outer_momentum: DiLoCo's outer Nesterov SGD.
        buffers: ``local`` or ``mean`` (DiLoCo's BN running statistics at a sync).
        steps: optimizer steps (the cosine decay ends there).
        sync_every: H.
    """

    strategy: str = "diloco"
    inner: str = "adamw"
    inner_lr: float | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    buffers: str = "mean"
    steps: int = 80
    sync_every: int = 10


BASE = Variant()
VARIANTS: dict[str, Variant] = {
    "ddp": Variant(strategy="ddp", inner="sgd"),
    "ddp_adamw": Variant(strategy="ddp", inner="adamw"),
    "diloco_local_buffers": replace(BASE, buffers="local"),  # cluster_diloco's run before the fix
    "diloco": BASE,
    "diloco_sgd_inner": replace(BASE, inner="sgd"),
    "diloco_outer_lr1_m0": replace(BASE, outer_lr=1.0, outer_momentum=0.0),
    "diloco_outer_lr07_m0": replace(BASE, outer_momentum=0.0),
    "diloco_h5": replace(BASE, sync_every=5),
    "diloco_sgd_inner_outer_lr1_m0": replace(BASE, inner="sgd", outer_lr=1.0, outer_momentum=0.0),
}


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The app's digits splits (seed 0, 32 px, normalised by the training split)."""
    dm = DigitsDataModule(batch_size=64, image_size=32, seed=SEED)
    dm.setup("fit")
    assert isinstance(dm.train_set, TensorDataset) and isinstance(dm.val_set, TensorDataset)
    return dm.train_set, dm.val_set


def shard_batches(data: TensorDataset, rank: int, replicas: int, batch: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Replica ``rank``'s batches, epoch after epoch, as Lightning's DistributedSampler and the app's
    ``drop_last`` loader give them."""
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=replicas, rank=rank, seed=SEED)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order) - batch + 1, batch):
            idx = torch.tensor(order[i : i + batch])
            yield data.tensors[0][idx], data.tensors[1][idx]
        epoch += 1


def optimizer(model: nn.Module, v: Variant, replicas: int) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """The app's optimizer and schedule: linear scaling from 64, 1 warmup step (the app's epoch of
    warmup at ``max_epochs=1000``), cosine decay to 0 at ``v.steps``."""
    base = v.inner_lr if v.inner_lr is not None else (1e-3 if v.inner == "adamw" else 0.05)
    decay = 0.05 if v.inner == "adamw" else 5e-4
    scaling = ScalingConfig(rule="linear", base_batch_size=64, warmup_epochs=1, decay="cosine")
    plan = scaling.plan(base_lr=base, per_device=64, replicas=replicas)
    groups = param_groups(model, decay)
    opt: torch.optim.Optimizer
    if v.inner == "adamw":
        opt = torch.optim.AdamW(groups, lr=plan.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=decay)
    else:
        opt = torch.optim.SGD(groups, lr=plan.lr, momentum=0.9, weight_decay=decay)
    return opt, scaling.scheduler(opt, plan, steps_per_epoch=1, total_steps=v.steps)


@torch.no_grad()
def accuracy(model: nn.Module, val: TensorDataset) -> float:
    model.eval()
    x, y = val.tensors
    correct = sum(int((model(x[i : i + 64]).argmax(1) == y[i : i + 64]).sum()) for i in range(0, len(y), 64))
    model.train()
    return correct / len(y)


def run(v: Variant, train: TensorDataset, val: TensorDataset, replicas: int = 2) -> list[tuple[int, float]]:
    """``(step, val_acc)`` every H steps of one variant."""
    torch.manual_seed(SEED)
    model = build_model("resnet18", num_classes=10, in_channels=1, stem="small", width=16)
    loss_fn = nn.CrossEntropyLoss()
    feeds = [shard_batches(train, r, replicas, 64) for r in range(replicas)]
    records = []
    if v.strategy == "ddp":
        opt, sched = optimizer(model, v, replicas)
        for step in range(1, v.steps + 1):
            opt.zero_grad(set_to_none=True)
            start = {k: b.clone() for k, b in model.named_buffers()}
            for r in reversed(range(replicas)):  # rank 0 last: its running statistics are the ones kept
                for k, b in model.named_buffers():
                    b.copy_(start[k])
                x, y = next(feeds[r])
                (loss_fn(model(x), y) / replicas).backward()
            opt.step()
            sched.step()
            if step % v.sync_every == 0:
                records.append((step, accuracy(model, val)))
        return records
    models = [copy.deepcopy(model) for _ in range(replicas)]
    opts = [optimizer(m, v, replicas) for m in models]
    loops = [OuterLoop([p for p in m.parameters()], algorithm="diloco", sync_every=v.sync_every,
                       outer_lr=v.outer_lr, outer_momentum=v.outer_momentum) for m in models]  # fmt: skip
    for step in range(1, v.steps + 1):
        for m, (opt, sched), feed in zip(models, opts, feeds, strict=True):
            x, y = next(feed)
            opt.zero_grad(set_to_none=True)
            loss_fn(m(x), y).backward()
            opt.step()
            sched.step()
        if step % v.sync_every == 0:
            mean = torch.stack([torch.cat([t.reshape(-1) for t in loop.tensors(0)]) for loop in loops]).mean(0)
            for loop in loops:
                loop.apply(0, mean)
            if v.buffers == "mean":
                average_buffers([list(m.buffers()) for m in models])
            records.append((step, accuracy(models[0], val)))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants, printed only")
    parser.add_argument("--quick", action="store_true", help="ddp and diloco, 4 steps, H = 2, printed only (CI)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only or (["ddp", "diloco"] if args.quick else list(VARIANTS))
    variants = {n: replace(VARIANTS[n], steps=4, sync_every=2) if args.quick else VARIANTS[n] for n in names}
    text = [header("diloco_sim: DiLoCo vs DDP on digits, 2 replicas simulated in one process"),
            load_line("start"),
            "# 64 samples per replica and step; H = 10 unless named; outer Nesterov SGD lr 0.7 momentum 0.9 "
            "unless named; val acc of replica 0 after each sync (step:acc)"]  # fmt: skip
    print("\n".join(text), flush=True)
    train, val = digits()
    start = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        records = run(variants[name], train, val)
        text.append(f"# {name}: {variants[name]}: " + ", ".join(f"{s}:{a:.3f}" for s, a in records)
                    + f" ({time.monotonic() - t0:.0f} s)")  # fmt: skip
        print(text[-1], flush=True)
        final = records[-1][1] if records else math.nan
        text.append(emit(f"sim_val_acc_{name}", final, "x"))
    text += [load_line("end"), f"# {time.monotonic() - start:.0f} s in all"]
    print("\n".join(text[-2:]), flush=True)
    if args.only is None and not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "diloco_sim.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
