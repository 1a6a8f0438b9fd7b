"""A :class:`~torch.distributed.device_mesh.DeviceMesh` over groups made by ``dist.new_group``.

Each mesh row is one group (:func:`~lightning_strategies.comm.groups.member_group`) with this strategy's backend
and timeout, passed as arguments, so no backend's private options object is needed (``init_device_mesh`` takes
the timeout only inside one), and a lost peer's abort reaches every group. NCCL still splits its communicator
from the default group's when that group is bound to a GPU.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_strategies.comm.groups import member_group

__all__ = ["device_mesh", "mesh_rows"]


def mesh_rows(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The ranks of each group along mesh dimension ``dim`` of a row-major mesh of ``shape``.

    For ``shape=(2, 3)``: along dim 0 ``[[0, 3], [1, 4], [2, 5]]``, along dim 1 ``[[0, 1, 2], [3, 4, 5]]``.
    """
    if not 0 <= dim < len(shape):
        raise ValueError(f"mesh dimension {dim} is out of range for a mesh of shape {shape}")
    ranks = torch.arange(math.prod(shape)).view(shape)
    return ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


def device_mesh(
    device_type: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> DeviceMesh:
    """A row-major mesh of ``shape`` over the default group's ranks, one new group per mesh row.

    A collective: every rank calls it with the same arguments (each creates every group, in the same
    order, as ``new_group`` requires). ``backend`` and ``timeout`` go to each new group; ``None`` takes the
    default group's.
    """
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"a mesh of shape {shape} has {math.prod(shape)} ranks, but the world has {world}; "
            "choose sizes whose product is the world size"
        )
    if len(names) != len(shape):
        raise ValueError(f"a mesh of shape {shape} needs {len(shape)} dimension names, got {names}")
    groups = [
        member_group(mesh_rows(shape, dim), backend=backend, timeout=timeout, what=f"the {device_type} mesh's group")
        for dim in range(len(shape))
    ]
    mesh = torch.arange(world).view(shape)
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)
