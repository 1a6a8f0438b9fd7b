"""Lamb's and Lars' multi-tensor path groups a param group's tensors by device and dtype
(``optim._foreach._group_by_device_and_dtype``). On a group of mixed dtypes it must equal the
per-tensor path, and the grouping itself must match the grouping written out by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_cases import make_problem
from torch import nn

from lightning_strategies.optim import Lamb, Lars
from lightning_strategies.optim._foreach import _group_by_device_and_dtype

DTYPES = (torch.float32, torch.float64, torch.float32, torch.bfloat16)


def test_groups_follow_the_first_list_in_order_of_first_appearance_with_indices() -> None:
    a32, b64, c32, d16 = (torch.zeros(2, dtype=d) for d in DTYPES)
    steps = [torch.tensor(float(i)) for i in range(4)]  # step counters: float32 on the CPU, whatever the params
    grouped = _group_by_device_and_dtype([[a32, b64, c32, d16], [None, steps[1], None, steps[3]], steps])
    cpu = torch.device("cpu")
    assert list(grouped) == [(cpu, torch.float32), (cpu, torch.float64), (cpu, torch.bfloat16)]
    (firsts, seconds, thirds), indices = grouped[(cpu, torch.float32)]
    assert indices == [0, 2]
    assert firsts[0] is a32 and firsts[1] is c32
    assert seconds == [None, None]
    assert thirds[0] is steps[0] and thirds[1] is steps[2]
    assert grouped[(cpu, torch.float64)][1] == [1] and grouped[(cpu, torch.bfloat16)][1] == [3]
    assert _group_by_device_and_dtype([[], []]) == {}


def _run(cls: type[torch.optim.Optimizer], foreach: bool, **kwargs: Any) -> list[torch.Tensor]:
    weights, grad_steps = make_problem(4, dtype=torch.float64, weight_scale=2.0, seed=7)
    dtypes = [DTYPES[i % 2] for i in range(len(weights))]  # float32 and float64 alternating in one group
    params = [nn.Parameter(w.to(d)) for w, d in zip(weights, dtypes, strict=True)]
    opt = cls(params, lr=0.01, foreach=foreach, **kwargs)
    for grads in grad_steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (Lamb, {"max_grad_norm": 1.0, "weight_decay": 0.01}),  # the global norm over both dtypes' groups
        (Lars, {"momentum": 0.9, "weight_decay": 1e-4}),  # first step: buffers created whole, put back by index
    ],
    ids=["lamb", "lars"],
)
def test_mixed_dtypes_in_one_group_equal_the_per_tensor_path(cls: type[torch.optim.Optimizer], kwargs: Any) -> None:
    a, b = _run(cls, True, **kwargs), _run(cls, False, **kwargs)
    # Both paths run the same elementwise operations in the same order per element; the norms may be
    # summed in another order (foreach norm kernels): a few ulp of float32 (~1e-7 relative) on the
    # trust ratio, ~1e-9 of a weight per step (lr * |r| ~ 1e-2). A tensor put back at the wrong index,
    # or a group stepped in the other group's dtype, is off by the weights' own size (~1).
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
