"""The pipeline on one GPU: its stages, mixed precision, loss scale and timers, against the unsplit CPU module.

World size 1 only. A pipeline's stages exchange activations point to point: NCCL refuses two
ranks on one GPU, and gloo's send/recv hand a CUDA tensor's data pointer to its host transport, so
two ranks need two GPUs. On one GPU, ``interleaved_1f1b`` with two stages per rank runs a real
two-stage schedule (forward and backward chunks of both stages, the activations handed between
them on the device) in one process.

What the CPU cannot show and these check: the stages' forward chunks under CUDA autocast
(``bf16-mixed``, ``16-mixed`` with a CUDA ``GradScaler``), the skipped step and halved scale on
CUDA, and the timers: every chunk and step timed with CUDA events, nothing in a step waiting for
the device (``torch.cuda.set_sync_debug_mode("error")``), the seconds read once when asked.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from gpu_utils import ON_CPU, PipeRegressor, assert_weights_close, fit, no_host_sync
from lightning.pytorch.plugins import MixedPrecision
from lightning_utils import regression_data
from torch import nn

from lightning_strategies import PipelineStrategy
from lightning_strategies.comm.pipeline import PipelineRuntime

pytestmark = pytest.mark.gpu
CPU_DRY_RUN = True  # LS_GPU_SUITE_ON_CPU=1 runs it on the CPU (gpu_utils.py)

# fp32 on both sides (TF32 off for matmuls by default): the order of sums inside GEMMs differs,
# ~1e-7 relative per op; six SGD steps of a 16-wide MLP stay below 1e-5. A wrong step moves ~1e-2.
ATOL = RTOL = 1e-4
# bf16 / fp16 against fp32 on the CPU: 2e-4 measured for bf16 on the CPU after six steps of this
# MLP (tests/gpu/test_precision_gpu.py); 2e-3 leaves 10x room and fails a skipped step (~2e-2).
MIXED_ATOL = 2e-3


def _two_stages() -> PipelineStrategy:
    return PipelineStrategy(schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4)


def _unsplit_on_the_cpu() -> dict[str, torch.Tensor]:
    """The reference: the same module unsplit, one CPU process. Four microbatches of 4 samples, each
    loss scaled by 1/4, give the full batch's mean-squared-error gradient (the pipeline's CPU tests
    assert the same equality). Not the pipeline itself on the CPU: its two stages in one gloo process
    send to their own rank, which gloo refuses under torch 2.11 (seen on the GPU machine's image)."""
    return fit("auto", torch.device("cpu"), model=PipeRegressor())


class _Dtype(pl.Callback):
    """The dtype of the outputs the module's training_step received (the last stage's)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        runtime = trainer.strategy.runtime  # type: ignore[attr-defined]
        if runtime is not None and runtime.last_outputs is not None:
            self.dtypes.add(str(runtime.last_outputs.dtype))


def test_two_stages_on_one_gpu_equal_the_cpu(cuda: torch.device) -> None:
    want = _unsplit_on_the_cpu()
    got = fit(_two_stages(), cuda, model=PipeRegressor())
    assert_weights_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_stages_on_one_gpu_are_close_to_fp32_on_the_cpu(precision: str, cuda: torch.device) -> None:
    """The stages run under the device's autocast: the last stage's outputs are bf16 / fp16, and
    the weights stay within the narrow format's tolerance of the fp32 CPU run. 16-mixed starts the
    scale at 2^8, far from fp16's overflow, so no step is skipped (checked)."""
    want = _unsplit_on_the_cpu()
    dtype = _Dtype()
    scaler = torch.amp.GradScaler(cuda.type, init_scale=2.0**8) if precision == "16-mixed" else None
    plugin = MixedPrecision(precision, cuda.type, scaler=scaler)  # type: ignore[arg-type]
    got = fit(_two_stages(), cuda, model=PipeRegressor(), plugins=[plugin], callbacks=[dtype])
    assert dtype.dtypes == {"torch.bfloat16" if precision == "bf16-mixed" else "torch.float16"}
    if scaler is not None:
        assert scaler.get_scale() == 2.0**8
    assert_weights_close(got, want, atol=MIXED_ATOL, rtol=0.0)


class _Overflow(pl.Callback):
    """An inf in a gradient at step 2; records, per step, the scale and whether the weights moved."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 2:
            next(p.grad for p in pl_module.parameters() if p.grad is not None).view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        moved = any(not torch.equal(a, b) for a, b in zip(self.before, pl_module.parameters(), strict=True))
        self.steps.append((moved, trainer.precision_plugin.scaler.get_scale()))  # type: ignore[attr-defined]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps: list[tuple[bool, float]] = []


def test_16_mixed_overflow_skips_the_step_and_halves_the_scale_on_the_gpu(cuda: torch.device) -> None:
    record = _Overflow()
    plugin = MixedPrecision("16-mixed", cuda.type, scaler=torch.amp.GradScaler(cuda.type))
    fit(_two_stages(), cuda, model=PipeRegressor(), plugins=[plugin], callbacks=[record], max_steps=4)
    assert record.steps == [(True, 65536.0), (True, 65536.0), (False, 32768.0), (True, 32768.0)]


@pytest.fixture
def one_process_group(cuda: torch.device) -> Any:
    """A world of this process alone (NCCL on a GPU, gloo on the CPU dry run)."""
    owned = not dist.is_initialized()
    if owned:
        backend, device_id = ("gloo", None) if ON_CPU else ("nccl", cuda)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def test_a_step_never_waits_for_the_gpu_and_the_timers_are_read_once(
    cuda: torch.device, one_process_group: Any
) -> None:
    """After the first step (the schedule's shape inference, a one-time collective), a training
    step enqueues its chunks and CUDA events without any host synchronisation; read_timings then
    waits once and reports each stage's compute inside the step's wall time."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).to(cuda)
    runtime = PipelineRuntime(
        net, counts=[2, 3], schedule="interleaved_1f1b", microbatches=4, loss_fn=nn.functional.mse_loss,
        group=one_process_group, device=cuda,
    )  # fmt: skip
    x, y = (t[:16].to(cuda) for t in regression_data().tensors)
    runtime.step(x, y)
    runtime.reset_timers()
    with no_host_sync():
        for _ in range(3):
            loss = runtime.step(x, y)
    assert loss is not None
    steps, wall, busy = runtime.read_timings()
    assert steps == 3 and len(busy) == 2
    assert all(b > 0 for b in busy) and sum(busy) <= wall
