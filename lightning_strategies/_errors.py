"""Helpers behind this package's error messages (private), kept apart so each rule lives in one place."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_options_set"]


def _is_default(name: str, value: Any) -> bool:
    param = inspect.signature(DDPStrategy.__init__).parameters.get(name)
    param = param or inspect.signature(DistributedDataParallel.__init__).parameters.get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return False
    try:
        return type(value) is type(param.default) and bool(value == param.default)
    except (RuntimeError, TypeError, ValueError):  # an == that raises or is ambiguous: a value of its own
        return False


def ddp_options_set(kwargs: Mapping[str, Any], allowed: Iterable[str]) -> list[str]:
    """The names of ``kwargs`` outside ``allowed`` that carry a setting, sorted: all but ``DDPStrategy`` and
    ``DistributedDataParallel`` options at their default, which LightningCLI (jsonargparse) passes although the user
    set none (it follows a strategy's ``**kwargs`` into those signatures)."""
    allowed = set(allowed)
    return sorted(name for name, value in kwargs.items() if name not in allowed and not _is_default(name, value))
