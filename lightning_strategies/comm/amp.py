"""Mixed precision over a process group: one loss-scale decision for every rank.

``torch.amp.GradScaler`` decides from a rank's own gradients whether a step overflowed; when the ranks
hold different gradients (a pipeline's stages, parameter-server shards) one may skip while another
steps, and their scales drift. :func:`agree_found_inf` (the pipeline's precision plugin) and
:class:`AgreedGradScaler` (the parameter servers) share the verdict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["AgreedGradScaler", "agree_found_inf", "ensure_scale"]


def ensure_scale(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Create the scaler's scale tensor on ``device`` if this rank has not scaled a loss yet.

    ``unscale_`` needs it, and a rank that never computes the loss (a pipeline's first stage) never calls
    ``scale``; scaling a zero initialises it as on any rank, without touching private state.
    """
    if scaler.is_enabled():
        scaler.scale(torch.zeros((), device=device))


def agree_found_inf(
    scaler: torch.amp.GradScaler,
    optimizer: Optimizer,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> None:
    """After ``scaler.unscale_(optimizer)``: every rank of ``group`` holds the group's inf/nan verdict.

    A collective at the same step on every rank. The per-device flags are all-reduced with MAX on
    ``device`` (NCCL has no CPU backend) and written back, so ``scaler.step`` skips on every rank or on
    none and ``scaler.update`` moves every scale alike. Nothing here waits for the device.

    Raises:
        RuntimeError: when ``unscale_`` has not run for ``optimizer`` this step.
    """
    if not scaler.is_enabled():
        return
    # torch keeps the per-optimizer flags here between unscale_ and step (torch/amp/grad_scaler.py);
    # there is no public accessor, and step/update read exactly this dict.
    state = scaler._per_optimizer_states[id(optimizer)]
    found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
    if state["stage"].name != "UNSCALED":
        raise RuntimeError(
            f"agree_found_inf found the scaler's state for this optimizer at stage {state['stage'].name}: expected "
            "UNSCALED. Fix: call scaler.unscale_(optimizer) first, then agree_found_inf, then scaler.step."
        )
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for value in found.values():
        flag = torch.maximum(flag, value.to(device=device, dtype=torch.float32, non_blocking=True))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not found:
        found[device] = flag
        return
    for value in found.values():
        value.copy_(flag.to(value.device, non_blocking=True))


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose skip verdict is shared by every rank (or kept per rank).

    :attr:`skipped` holds the last verdict as a device tensor (1.0: skipped), to log without a read per step.

    Args:
        device: the device of the gradients (``"cuda"``, ``"cpu"``).
        agree: run :func:`agree_found_inf` over ``group`` after every ``unscale_`` (``"ps"``: a rank skipping
            alone would never push and the shards' barrier would wait for it). ``False`` (``"async"``, where a
            per-step collective would pair different steps): an overflowing rank skips its own push and
            lowers its own scale (the step still counts, so nothing waits for it).
        group: the process group to agree over (default: the default group).
        **kwargs: as ``torch.amp.GradScaler`` (``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``enabled``).
    """

    def __init__(self, device: str = "cuda", *, agree: bool = True, group: Any = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.agree = agree
        self.group = group
        self.skipped: torch.Tensor | None = None

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler, *, agree: bool = True, group: Any = None) -> AgreedGradScaler:
        """The same scaler (options, scale and growth tracker) with the verdict shared (``agree``).

        Raises:
            TypeError: for a ``GradScaler`` subclass other than this one (replacing it would drop its behaviour).
        """
        if isinstance(scaler, AgreedGradScaler):
            scaler.agree, scaler.group = agree, group
            return scaler
        if type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
            raise TypeError(
                f"the parameter servers found a gradient scaler of type {type(scaler).__qualname__}: expected a "
                "torch.amp.GradScaler, which they replace by an AgreedGradScaler with the same options and state "
                "so every rank skips an overflowing step together. Fix: pass a plain torch.amp.GradScaler to "
                "MixedPrecision (or none: Lightning makes one), or subclass "
                "lightning_strategies.comm.amp.AgreedGradScaler."
            )
        new = cls(
            scaler._device,
            agree=agree,
            group=group,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler.is_enabled(),
        )
        if scaler.is_enabled():
            new.load_state_dict(scaler.state_dict())
        return new

    def unscale_(self, optimizer: Optimizer) -> None:
        """Unscale, then share the verdict (``agree``) and keep it on the device in :attr:`skipped`."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        assert self._scale is not None  # unscale_ made it
        device = self._scale.device
        if self.agree:
            agree_found_inf(self, optimizer, device, self.group)
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        found = torch.zeros((), dtype=torch.float32, device=device)
        for value in flags:
            found = torch.maximum(found, value.to(device=device, dtype=torch.float32, non_blocking=True))
        self.skipped = found  # 1.0 when GradScaler.step will skip, else 0.0 (flags are 0 or 1)
