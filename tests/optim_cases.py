"""Cases shared by the Lamb and Lars tests (the ``foreach`` fixture is in tests/unit/conftest.py)."""

from __future__ import annotations

import torch

SHAPES = [(1,), (7,), (5, 3), (4, 3, 3, 3)]  # scalar-ish, 1-D, 2-D (linear), 4-D (conv)


def make_problem(
    steps: int, *, dtype: torch.dtype = torch.float64, weight_scale: float = 1.0, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Seeded weights of every shape in SHAPES, and ``steps`` rounds of growing gradients."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g, dtype=dtype) * weight_scale for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=dtype) * (k + 1) for s in SHAPES] for k in range(steps)]
    return weights, grads
