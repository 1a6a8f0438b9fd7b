"""Mixed precision over a process group: one loss-scale decision for every rank.

``torch.amp.GradScaler`` decides from the gradients a rank holds whether a step overflowed
(``unscale_`` records an inf/nan flag per device) and skips the step and halves the scale, or
steps and eventually grows it. When each rank holds different gradients (a pipeline's stages,
parameter-server shards whose gradients are never averaged locally) the ranks decide apart: one
skips while another steps, and their scales drift, so the next step's gradients are scaled
differently on each rank. :func:`agree_found_inf` makes the decision common: after ``unscale_``,
every rank's flag becomes the maximum over the group, so ``step`` skips on all ranks or on none
and ``update`` moves every rank's scale the same way.

Used by the pipeline's precision plugin (``strategies/_pipeline_plugins.py``); any strategy whose
ranks hold different gradients can call it between ``unscale_`` and ``step``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["agree_found_inf", "ensure_scale"]


def ensure_scale(scaler: torch.amp.GradScaler, device: torch.device) -> None:
    """Create the scaler's scale tensor on ``device`` if this rank has not scaled a loss yet.

    ``unscale_`` needs it, and a rank that never computes the loss (a pipeline's first stage)
    never calls ``scale``. Scaling a zero through the public API initialises it as on any rank
    (the same ``init_scale``), without touching private state.
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

    The flags this rank recorded (one per device its gradients are on) are reduced to one
    0-d float32 on ``device`` (the group's device: NCCL has no CPU backend), all-reduced with
    MAX, and written back into every per-device flag; a rank without gradients gets the flag
    as its own. ``scaler.step`` then skips on every rank or on none, and ``scaler.update``
    halves (or grows) every rank's scale alike. Nothing here waits for the device: the
    scaler's own ``step`` reads the flag (one host synchronisation, as without this call).

    A collective: every rank of ``group`` calls it at the same step.

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
