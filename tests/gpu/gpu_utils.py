"""Helpers of the GPU suite (importable as ``gpu_utils`` from its test modules).

``LS_GPU_SUITE_ON_CPU=1`` runs the suite on the CPU instead (``tests/conftest.py`` then does not
skip it): every comparison is then CPU against CPU, so it proves nothing about CUDA, but it runs
the suite's own machinery (fits, spawned ranks, comparisons) on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_utils import GlobalBatchSampler, TinyRegressor, regression_data
from torch.utils.data import DataLoader

__all__ = [
    "ON_CPU", "PipeRegressor", "assert_weights_close", "fit", "no_host_sync", "own_process_group", "suite_device",
]  # fmt: skip

ON_CPU = os.environ.get("LS_GPU_SUITE_ON_CPU") == "1"


def suite_device() -> torch.device:
    """The device under test: the first GPU (the CPU under ``LS_GPU_SUITE_ON_CPU=1``)."""
    return torch.device("cpu") if ON_CPU else torch.device("cuda", 0)


@contextmanager
def own_process_group() -> Iterator[None]:
    """Destroy the default process group a fit in this process made, when the block ends.

    Lightning destroys the group it made only at exit: a world-1 fit would leave it to the next fit,
    which would then run on this one's backend (gloo where it should be NCCL, or NCCL for CPU tensors:
    "No backend type associated with device type cpu"). Under torch 2.11 a second NCCL group made in one
    process crashes in the device mesh's ``split_group``, so ``benchmarks/gpu_check.sh`` runs each test in
    its own process; this keeps a test's CPU and GPU fits apart."""
    owned = not dist.is_initialized()
    try:
        yield
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise on any operation that makes the host wait for the device (``.item()``, ``bool()``, a
    blocking copy to the host, ...) inside the block: ``torch.cuda.set_sync_debug_mode("error")``.
    (Nothing to check on the CPU.)"""
    if ON_CPU:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()  # work queued before the block is not the block's
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class PipeRegressor(TinyRegressor):
    """TinyRegressor with the pipeline contract: its net is 3 blocks (no batch norm: exact math)."""

    def pipeline_layers(self) -> torch.nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs, targets)


def fit(
    strategy: Any,
    device: torch.device,
    *,
    world: int = 1,
    batch_size: int = 16,
    ranks_per_replica: int = 1,
    model: pl.LightningModule | None = None,
    max_steps: int = 6,
    **trainer_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Fit :class:`TinyRegressor` (or ``model``) on ``device`` and return the final weights on the CPU.

    ``world`` > 1 runs that many spawned ranks all on ``device`` (``strategy`` must have been built with
    ``parallel_devices=[device] * world`` and a backend that allows it); ``batch_size`` is per rank and
    the global batch of each step is the same contiguous slice of the data at every world size
    (:class:`GlobalBatchSampler`), so world 2 at 8 equals world 1 at 16 for data parallelism.
    """
    model = model if model is not None else TinyRegressor()
    data = regression_data()
    sampler = GlobalBatchSampler(len(data), batch_size, ranks_per_replica=ranks_per_replica)
    trainer = pl.Trainer(
        accelerator=device.type, devices=1, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **trainer_kwargs,
    )  # fmt: skip
    assert trainer.world_size == world, (trainer.world_size, world)
    with own_process_group():
        trainer.fit(model, DataLoader(data, batch_size=batch_size, sampler=sampler))
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def assert_weights_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, atol: float, rtol: float
) -> None:
    """Every tensor of ``got`` close to ``want``'s, naming the first one that is not."""
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}")
