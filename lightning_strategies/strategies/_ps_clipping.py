"""Gradient clipping under the parameter servers, the workers' side: what ``"ps"`` and ``"async"`` check,
what the shards are told (:mod:`lightning_strategies.comm.ps.clip`), and the worker's clipping switched off.

Under ``"ps"`` DDP's semantics hold: Lightning clips the *averaged* gradient, which only the shards see,
so the shards clip and the worker's own clipping is switched off. Under ``"async"`` each push is one
worker's gradient applied alone, as one optimizer step on one device: the worker clips its own full
gradient, Lightning's clipping as usual, and pre-normalises it for ``Lamb(max_grad_norm=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer

from lightning_strategies.comm.ps.clip import ClipSpec
from lightning_strategies.comm.ps.spec import OptimizerSpec
from lightning_strategies.optim._foreach import _global_clip_factor
from lightning_strategies.optim.lamb import Lamb

__all__ = ["WorkerClippingOff", "global_norm_max", "prenormalise_like_lamb", "server_clip_spec"]


def global_norm_max(strategy: str, optimizer: Optimizer, spec: OptimizerSpec, num_servers: int) -> float | None:
    """``max_grad_norm`` when the optimizer clips by a gradient norm that spans several shards, else ``None``.

    Raises:
        ValueError: for an optimizer other than :class:`~lightning_strategies.optim.Lamb` (or a subclass)
            with ``max_grad_norm`` over several shards: only Lamb's step takes the whole model's norm.
    """
    max_grad_norm = spec.defaults.get("max_grad_norm")
    if max_grad_norm is None or num_servers <= 1:
        return None
    if issubclass(spec.optimizer_class, Lamb):
        return float(max_grad_norm)
    raise ValueError(
        f"{strategy} found {type(optimizer).__qualname__}(max_grad_norm={max_grad_norm}) with "
        f"num_servers={num_servers}: the global gradient norm spans every shard, and only "
        "lightning_strategies.optim.Lamb's step takes it from outside (`global_grad_norm`). Expected Lamb, "
        "max_grad_norm=None, or num_servers=1. Fix: use Lamb, Trainer(gradient_clip_val=...) instead of "
        "max_grad_norm, or num_servers=1."
    )


def server_clip_spec(
    strategy: str, trainer: pl.Trainer, module: pl.LightningModule, *, optimizer_norm: bool
) -> ClipSpec | None:
    """What the shards clip for ``"ps"`` (``None``: nothing).

    Raises:
        ValueError: when the module overrides ``configure_gradient_clipping``: it would clip the worker's local
            gradient, and code cannot be sent to the shards.
    """
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        raise ValueError(
            f"{strategy} found {type(module).__qualname__}.configure_gradient_clipping overridden: expected "
            "Lightning's own, because under a parameter server the averaged gradient (what DDP clips) exists only "
            "on the shards, which clip it by Trainer(gradient_clip_val=..., gradient_clip_algorithm=...), and a "
            "custom hook cannot run there. Fix: remove the override and set the Trainer's gradient_clip_val / "
            "gradient_clip_algorithm, or use strategy='ddp' (or 'async', where each worker clips its own gradient)."
        )
    algorithm = trainer.gradient_clip_algorithm
    spec = ClipSpec(
        clip_val=float(trainer.gradient_clip_val) if trainer.gradient_clip_val else None,
        algorithm=str(getattr(algorithm, "value", algorithm) or "norm"),
        optimizer_norm=optimizer_norm,
    )
    return spec if spec.clips or spec.optimizer_norm else None


class WorkerClippingOff:
    """Switches a precision plugin's ``clip_gradients`` off on a worker while the shards clip.

    Lightning clips through the strategy's precision plugin (``Precision.clip_gradients``, called from the
    module's ``configure_gradient_clipping``); this shadows that public method on the one plugin instance, for
    whatever precision is in use, and :meth:`restore` removes the shadow.
    """

    def __init__(self, plugin: Precision) -> None:
        self.plugin = plugin
        setattr(plugin, "clip_gradients", self._skip)  # noqa: B010  (an instance attribute over the method)

    @staticmethod
    def _skip(*args: Any, **kwargs: Any) -> None:
        """The shards clip the averaged gradient; the worker's local one is pushed as it is."""

    def restore(self) -> None:
        """The plugin's own clipping again."""
        if vars(self.plugin).get("clip_gradients") == self._skip:
            del self.plugin.clip_gradients


def prenormalise_like_lamb(grads: Sequence[Tensor | None], max_grad_norm: float) -> None:
    """Lamb's ``max_grad_norm`` rule on a worker's whole gradient, in place: ``g * min(1, max_grad_norm / ||g||)``.

    For ``"async"`` over several shards: each shard's Lamb sees a slice of one push, whose norm is at most the
    pre-normalised whole's, so its own pre-normalisation leaves the slice as it is (up to rounding).
    """
    present = [g for g in grads if g is not None]
    if not present:
        return
    factor = _global_clip_factor(present, max_grad_norm, foreach=False)  # Lamb's own factor, not a copy of it
    for g in present:
        g.mul_(factor.to(g.device))
