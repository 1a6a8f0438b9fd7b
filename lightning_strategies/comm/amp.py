"""Mixed precision under the parameter servers: one overflow decision for every rank, no Lightning import.

Under ``16-mixed`` a ``torch.amp.GradScaler`` skips the optimizer step when the unscaled
gradients hold an inf or a NaN, and lowers its scale. DDP decides from the *averaged* gradients,
so every rank decides alike. A parameter server never averages on the worker: each rank would
decide from its own gradients, and a rank that skips never pushes, so the shards' barrier waits
for it until its timeout. :class:`AgreedGradScaler` makes the decision the same everywhere:

- ``agree=True`` (synchronous ``"ps"``): after unscaling, the found-inf flag is summed over every
  rank (one all-reduce of one float on the process group, on the device: no host sync of its
  own), so every rank skips, or steps, together, and every scaler lowers or grows its scale in
  the same step. As under DDP, an overflow on any rank skips the step everywhere, and no
  gradient with an inf reaches a shard.
- ``agree=False`` (``"async"``, where ranks step at their own pace and a per-step collective
  would pair different steps): a rank whose gradients overflow skips its own push and lowers its
  own scale; the others go on. Pushes never carry an inf into the shards, and no one waits for
  the skipped push (async has no barrier; the staleness gate counts pushes, so a bounded run
  waits only until the skipping worker's next push).

Either way :attr:`AgreedGradScaler.skipped` holds the last step's decision as a device tensor
(1.0 skipped, 0.0 stepped), which the strategies log at Lightning's cadence without reading it
per step. ``GradScaler.step`` itself reads the flag on the host (``.item()``), as under DDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["AgreedGradScaler"]


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose skip decision is shared by every rank (or kept per rank).

    Args:
        device: the device of the gradients (``"cuda"``, ``"cpu"``).
        agree: sum the found-inf flag over the process group before the step decision.
        group: the process group to agree over (default: the default group).
        **kwargs: as ``torch.amp.GradScaler`` (``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``enabled``).
    """

    def __init__(self, device: str = "cuda", *, agree: bool = True, group: Any = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.agree = agree
        self.group = group
        self.skipped: Tensor | None = None

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler, *, agree: bool = True, group: Any = None) -> AgreedGradScaler:
        """The same scaler (options, scale and growth tracker) with the shared decision.

        Raises:
            TypeError: for a subclass of ``GradScaler`` other than this one, whose own behaviour
                replacing it would drop.
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
        """Unscale, then replace the found-inf flags by their sum over the ranks (``agree``)."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        state = self._per_optimizer_states[id(optimizer)]
        flags = [f.reshape(()) for f in state["found_inf_per_device"].values()]
        assert self._scale is not None  # unscale_ made it
        found = torch.stack(flags).sum() if flags else torch.zeros((), device=self._scale.device)
        if self.agree and dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, group=self.group)  # one float, enqueued on the device with NCCL
        # GradScaler.step skips when any flag is nonzero, update() backs off likewise
        state["found_inf_per_device"] = {found.device: found}
        self.skipped = (found > 0).to(torch.float32)
