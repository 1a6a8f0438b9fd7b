"""A :class:`~torch.distributed.device_mesh.DeviceMesh` over groups made by ``dist.new_group``.

Each mesh row is one ``new_group`` with this strategy's backend and timeout, passed as arguments, so no
backend's private options object is needed (``init_device_mesh`` takes the timeout only inside one).
NCCL still splits its communicator from the default group's when that group is bound to a GPU.

A GPU-bound gloo default group (``process_group_backend="gloo"`` on GPUs: Lightning binds the group to the
device) cannot make subgroups under torch 2.11: there ``new_group`` asks gloo for a split it lacks
(``benchmarks/results/gpu_check_2026-12-04_run5.txt``), as ``init_device_mesh`` did
(``..._run4_tensor_gloo.txt``). :func:`device_mesh` then says so and what to change.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "mesh_rows"]


def mesh_rows(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The ranks of each group along mesh dimension ``dim`` of a row-major mesh of ``shape``.

    For ``shape=(2, 3)``: along dim 0 ``[[0, 3], [1, 4], [2, 5]]``, along dim 1 ``[[0, 1, 2], [3, 4, 5]]``.
    """
    if not 0 <= dim < len(shape):
        raise ValueError(f"mesh dimension {dim} is out of range for a mesh of shape {shape}")
    ranks = torch.arange(math.prod(shape)).view(shape)
    return ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


def _new_group_failed(row: list[int], device_type: str, backend: str | None, error: BaseException) -> str:
    message = (
        f"could not make the mesh's group of ranks {row} (backend {backend or dist.get_backend()}, device "
        f"{device_type}, torch {torch.__version__}): {type(error).__name__}: {error}."
    )
    if "split" in str(error):
        message += (
            " Under torch 2.11, gloo cannot make subgroups of a default group bound to a GPU (Lightning binds it"
            " on GPUs). Fix: on GPUs pass process_group_backend='nccl', or use torch 2.14 (this package's pin, whose"
            " gloo supports splitting)."
        )
    return message


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
    rank = dist.get_rank()
    groups: list[dist.ProcessGroup] = []
    for dim in range(len(shape)):
        mine: dist.ProcessGroup | None = None
        for row in mesh_rows(shape, dim):
            try:
                group = dist.new_group(row, backend=backend, timeout=timeout)
            except (AttributeError, RuntimeError) as e:
                raise RuntimeError(_new_group_failed(row, device_type, backend, e)) from e
            if rank in row:
                assert isinstance(group, dist.ProcessGroup)  # new_group gives non-members a sentinel
                mine = group
        assert mine is not None  # the rows of a dimension cover every rank
        groups.append(mine)
    mesh = torch.arange(world).view(shape)
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)
