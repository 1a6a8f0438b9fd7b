"""Weight-decay parameter groups: decay on weights, none on biases and normalisation layers."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["param_groups"]

log = logging.getLogger("lightning_strategies")


def param_groups(model: nn.Module, weight_decay: float, *, no_decay: Iterable[str] = ("bias",)) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed group.

    As timm's ``param_groups_weight_decay`` and the LAMB/LARS papers do, a parameter gets ``weight_decay=0`` and
    ``layer_adaptation=False`` (trust ratio 1 in :class:`~lightning_strategies.optim.Lamb` and
    :class:`~lightning_strategies.optim.Lars`; other torch optimizers ignore the key) when it has at most one
    dimension (biases, norm layers) or its full name, or its name's last component, is in ``no_decay``. Frozen
    parameters are left out; the group sizes are logged at INFO on the ``lightning_strategies`` logger.

    Args:
        model: the module whose ``named_parameters()`` are grouped (shared parameters once).
        weight_decay: the decayed group's ``weight_decay``.
        no_decay: extra names (full, or last component) that get no decay, e.g. ``("bias", "pos_embed")``.

    Returns:
        ``[{"params", "weight_decay": weight_decay, "layer_adaptation": True},
        {"params", "weight_decay": 0.0, "layer_adaptation": False}]``, without empty groups.

    Raises:
        ValueError: ``weight_decay`` is negative or not a number, or ``no_decay`` is a string.
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, int | float) or not weight_decay >= 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r}; expected a float >= 0.")
    if isinstance(no_decay, str):
        raise ValueError(
            f"no_decay must be a collection of names, found the string {no_decay!r}; write no_decay=({no_decay!r},)."
        )
    names = set(no_decay)
    decay: list[nn.Parameter] = []
    skip: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or name in names or name.rsplit(".", 1)[-1] in names:
            skip.append(param)
        else:
            decay.append(param)
    log.info(
        "param_groups: %d tensors (%d parameters) with weight_decay=%g; %d tensors (%d parameters) "
        "without weight decay or layer adaptation (biases, norm layers, %s)",
        len(decay),
        sum(p.numel() for p in decay),
        weight_decay,
        len(skip),
        sum(p.numel() for p in skip),
        ", ".join(sorted(names)) or "no extra names",
    )
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay), "layer_adaptation": True})
    if skip:
        groups.append({"params": skip, "weight_decay": 0.0, "layer_adaptation": False})
    return groups
