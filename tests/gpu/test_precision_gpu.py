"""``bf16-mixed`` and ``16-mixed`` fits on one GPU against the fp32 fit on the CPU.

Mixed precision changes the numbers, so the reference is the fp32 run and the tolerance is the
narrow format's: on the CPU, ``bf16-mixed`` ends 2e-4 (max abs) from fp32 after these six steps
(measured, this MLP and data); fp16 carries 3 more mantissa bits. 2e-3 leaves 10x room and still
fails a skipped or doubled step (each moves the weights by ~2e-2).

``16-mixed`` uses a GradScaler starting at 2**8 (not 2**16): the scaled gradients stay far from
fp16's 65504, so no step is skipped for an overflow and the run is comparable step for step; the
test checks that the scale never dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gpu_utils import ON_CPU, assert_weights_close, fit
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_strategies import AsyncParameterServerStrategy, ParameterServerStrategy, RingAllReduceStrategy

pytestmark = pytest.mark.gpu
CPU_DRY_RUN = True  # LS_GPU_SUITE_ON_CPU=1 runs it on the CPU (gpu_utils.py)

ATOL = 2e-3
INIT_SCALE = 2.0**8

STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": DDPStrategy,
    "ring": RingAllReduceStrategy,
    "ps": ParameterServerStrategy,
    "async": AsyncParameterServerStrategy,
}


def _steps(name: str) -> dict[str, Any]:
    return {"max_steps": -1, "max_epochs": 1} if name == "async" else {}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_bf16_mixed_on_the_gpu_is_close_to_fp32_on_the_cpu(name: str, cuda: torch.device) -> None:
    want = fit(STRATEGIES[name](), torch.device("cpu"), **_steps(name))
    got = fit(STRATEGIES[name](), cuda, precision="bf16-mixed", **_steps(name))
    assert_weights_close(got, want, atol=ATOL, rtol=0.0)


@pytest.mark.skipif(ON_CPU, reason="fp16 autocast with a GradScaler needs CUDA (Lightning turns it into bf16 on CPU)")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_16_mixed_on_the_gpu_is_close_to_fp32_on_the_cpu(name: str, cuda: torch.device) -> None:
    want = fit(STRATEGIES[name](), torch.device("cpu"), **_steps(name))
    scaler = torch.amp.GradScaler("cuda", init_scale=INIT_SCALE)
    precision = MixedPrecision("16-mixed", "cuda", scaler=scaler)
    got = fit(STRATEGIES[name](), cuda, plugins=[precision], **_steps(name))
    assert scaler.get_scale() == INIT_SCALE  # no step was skipped for an overflow
    assert_weights_close(got, want, atol=ATOL, rtol=0.0)
