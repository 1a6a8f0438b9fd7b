"""Lamb and Lars with ``foreach=True`` on CUDA: the same update as the per-tensor path on the CPU,
and no host synchronisation inside ``step()`` (the step counters live on the host, the trust
ratios and the global clip factor stay on the device)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_utils import no_host_sync
from optim_cases import make_problem
from torch import nn

from lightning_strategies.optim import Lamb, Lars

pytestmark = pytest.mark.gpu
CPU_DRY_RUN = True  # LS_GPU_SUITE_ON_CPU=1 runs it on the CPU (gpu_utils.py)

# fp32 on both sides: the elementwise updates are the same IEEE operations; the per-tensor norms
# (and Lamb's global clip norm) are sums in another order, ~1e-7 relative for these sizes, and the
# trust ratios divide two of them. Five steps stay near 1e-6; a wrong trust ratio or a missed
# clip changes a weight by >= 1e-3.
ATOL, RTOL = 1e-5, 1e-5

CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "lamb": (Lamb, {"lr": 0.01, "weight_decay": 0.01}),
    "lamb_clip": (Lamb, {"lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 1.0, "trust_clip": True}),
    "lars": (Lars, {"lr": 0.1, "weight_decay": 1e-4}),
    "lars_nesterov_clip": (Lars, {"lr": 0.1, "weight_decay": 1e-4, "nesterov": True, "trust_clip": True}),
}


def _run(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], device: torch.device, foreach: bool
) -> list[torch.Tensor]:
    weights, grad_steps = make_problem(5, dtype=torch.float32)
    params = [nn.Parameter(w.to(device)) for w in weights]
    grads = [[g.to(device) for g in step] for step in grad_steps]  # uploaded before any checked step
    opt = cls(params, foreach=foreach, **kwargs)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g
        with no_host_sync():  # raises on CUDA if the step waits for the device; nothing to check on the CPU
            opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize("case", list(CASES))
def test_foreach_on_cuda_equals_the_per_tensor_update_on_the_cpu(case: str, cuda: torch.device) -> None:
    cls, kwargs = CASES[case]
    want = _run(cls, kwargs, torch.device("cpu"), foreach=False)
    got = _run(cls, kwargs, cuda, foreach=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m, i=i: f"tensor {i}: {m}")
