"""The model's buffers at LocalSGD / DiLoCo's outer sync (BatchNorm's running statistics).

LocalSGD and DiLoCo average parameters (or their pseudo-gradients); torchft's ``LocalSGD`` and
``DiLoCo`` touch nothing else, so every replica keeps the running statistics its own inner
steps gathered, and evaluates the global weights with them. Those statistics were taken from
one replica's batches under its inner weights, not the global ones (which the outer step moved,
with momentum, past every replica's); the replicas' mean, taken at the sync, is the closer
estimate and the same on every replica, as the weights are. On the digits app it decided the
accuracy (``benchmarks/diloco_sim.py``, results/diloco_sim.txt).

Floating-point buffers are averaged. Integer ones (``num_batches_tracked``) are counters that
every replica advances alike between syncs; they are left as they are (a mean of counters
would be a float, and an integer mean would not be what any replica counted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["average_buffers", "floating_buffers"]


def floating_buffers(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The floating-point tensors of ``buffers`` (those averaged at a sync), in order."""
    return [b for b in buffers if b.is_floating_point()]


@torch.no_grad()
def average_buffers(replicas: Sequence[Sequence[torch.Tensor]]) -> None:
    """Set every replica's floating buffers to their mean over ``replicas`` (one process holding
    several replicas: the one-process reference of the sync's buffer all-reduce).

    Args:
        replicas: each replica's buffers, in the same order.
    """
    floats = [floating_buffers(bs) for bs in replicas]
    for same in zip(*floats, strict=True):
        mean = torch.stack([b.to(torch.float64) for b in same]).mean(0)
        for b in same:
            b.copy_(mean)
