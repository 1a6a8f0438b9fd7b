"""What the strategies whose optimizer steps on parameter-server shards share (``"ps"``, ``"async"``,
``"ps_ring"``): the set-ups they refuse, and the optimizer step that runs Lightning's closure and then the
exchange with the shards instead of a local update."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

__all__ = ["closure_then_exchange", "require_automatic_optimization", "require_one_optimizer"]


def require_automatic_optimization(strategy: str, module: pl.LightningModule) -> None:
    """Raises:
    ValueError: under manual optimization (the shards step inside Lightning's ``optimizer_step``)."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{strategy} found `automatic_optimization = False`: expected automatic optimization, because the "
            "optimizer step runs on the shards inside Lightning's optimizer_step. Fix: use automatic optimization, "
            "or strategy='ddp' for manual optimization."
        )


def require_one_optimizer(strategy: str, optimizers: Sequence[Optimizer]) -> None:
    """Raises:
    ValueError: for another number of optimizers than one (the shards run one over the whole model)."""
    if len(optimizers) != 1:
        raise ValueError(
            f"{strategy} found {len(optimizers)} optimizers from configure_optimizers: expected exactly one, because "
            "the shards run one optimizer over the whole model. Fix: return one optimizer (use param groups for "
            "different hyperparameters)."
        )


def closure_then_exchange(
    optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any], exchange: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The body of a step pre-hook: Lightning's closure (forward and backward), then ``exchange`` (the shards
    step), then every gradient dropped, so the local update that follows finds none. Returns the step's arguments
    without the closure. A pre-hook keeps every precision plugin's handling: under ``16-mixed`` the scaler calls
    ``step`` only when it does not skip, and LR schedulers see the step."""
    # torch passes the step's own arguments, the optimizer first
    kwargs = dict(kwargs)
    closure = kwargs.pop("closure", None) if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is not None:
        with torch.enable_grad():
            closure()
    exchange()
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    return args[:1], kwargs
