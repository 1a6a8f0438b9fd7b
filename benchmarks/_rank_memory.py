"""What one rank of a fit holds: tensor bytes (parameters, buffers, gradients, optimizer state, a
co-located parameter-server shard) and peak RSS growth, read by a callback (``pipeline_memory.py``,
``advisor_validation.py``).

RSS: the resident set size at ``setup`` (after the imports and the process group, before the
model exists) is the baseline; the kernel's peak-RSS counter is reset there
(``/proc/self/clear_refs``) and its peak (``VmHWM``) read at the end of training. Tensors: before
every optimizer step and at the end of training (before the strategy gathers anything for a
checkpoint), each storage counted once (a DTensor by its local shard; meta tensors, which hold
nothing, not at all); the largest sum is kept.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_strategies.comm.ps.hosting import local_shard

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_allocations() -> None:
    """Every allocation of 1 MiB or more mapped on its own and unmapped when freed (a fixed
    threshold: glibc otherwise raises it as large blocks are freed, and serves them from a heap it
    keeps), so the peak RSS is what was held at once, not the heap's history."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for text in f:
            if text.startswith(key):
                return int(text.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def _state_tensors(optimizer: torch.optim.Optimizer | None) -> list[Any]:
    if optimizer is None:  # a shard whose slices hold no trainable tensor
        return []
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` and meta tensors skipped)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.is_meta or local.numel() == 0:
            continue
        storage = local.untyped_storage()
        seen[(storage.data_ptr(), str(local.device))] = storage.nbytes()
    return sum(seen.values())


def rank_tensor_bytes(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, int]:
    """This rank's tensor bytes by kind: the module's, the trainer's optimizers', the local shard's."""
    params = list(module.parameters())
    out = {
        "params": tensor_bytes([*params, *module.buffers()]),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(t for o in trainer.optimizers for t in _state_tensors(o)),
    }
    shard = local_shard(trainer.global_rank)
    if shard is not None:  # a parameter server hosted by this rank: its slice's values and state, at rest.
        # Its averaged gradient exists only inside its apply (set, stepped, freed on the server's thread), so a
        # read from this thread would catch it or not by timing; the advisor counts it in the peak's buffers.
        out["shard"] = tensor_bytes([*shard.params, *_state_tensors(shard.optimizer)])
    return out


class RankMemory(pl.Callback):
    """Baseline RSS at setup (peak counter reset there); peak RSS growth at the end of training and the
    most tensor bytes held at once, read before every optimizer step (gradients and the state of the
    steps before all held) and at the end of training; written to ``out/rank<r>.json``
    (``growth_mib``, ``tensor_mib`` and, at that peak, bytes by kind)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.baseline_kib = 0
        self.peak: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        self.baseline_kib = status_kib("VmRSS:")

    def _read(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kinds = rank_tensor_bytes(trainer, pl_module)
        if sum(kinds.values()) > sum(self.peak.values()):
            self.peak = kinds

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._read(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read(trainer, pl_module)
        row: dict[str, float] = {
            "growth_mib": (status_kib("VmHWM:") - self.baseline_kib) / 1024,
            "tensor_mib": sum(self.peak.values()) / 2**20,
            **{f"{k}_bytes": float(v) for k, v in self.peak.items()},
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))
