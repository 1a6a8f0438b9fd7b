"""The process groups this package makes, each known to the abort of a lost peer.

Every group goes through :func:`new_group`, which hands it to
:func:`~lightning_strategies.comm.abort.add_abort_group`: torch has no public list of a process's groups,
and a lost peer's abort must reach each NCCL group (subgroups first). :func:`member_group` makes one group
per row of ranks (every rank makes every row's group, in the same order, as ``dist.new_group`` requires)
and gives each rank the group of its row.

A GPU-bound gloo default group (``process_group_backend="gloo"`` on GPUs: Lightning binds the group to the
device) cannot make subgroups under torch 2.11: there ``dist.new_group`` asks gloo for a split it lacks
(``benchmarks/results/gpu_check_2026-12-04_run5.txt``), as ``init_device_mesh`` did
(``..._run4_tensor_gloo.txt``). :func:`member_group` then says so and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_strategies.comm.abort import add_abort_group

__all__ = ["member_group", "new_group"]


def new_group(
    ranks: Sequence[int] | None = None, *, backend: str | None = None, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """``dist.new_group`` for a group this rank is in, registered with the abort of a lost peer.

    A collective: every rank of the world calls it with the same arguments. ``ranks=None``: the whole
    world; ``backend`` and ``timeout`` ``None``: the default group's.

    Raises:
        ValueError: this rank is not in ``ranks`` (use :func:`member_group` to make groups for others).
    """
    group = dist.new_group(None if ranks is None else list(ranks), backend=backend, timeout=timeout)
    if not isinstance(group, dist.ProcessGroup):  # dist.new_group gives a non-member a sentinel
        raise ValueError(
            f"new_group: rank {dist.get_rank()} is not in ranks {list(ranks or [])}; a rank gets only groups it "
            "is in (member_group makes every row's group and returns this rank's)"
        )
    add_abort_group(group)
    return group


def member_group(
    rows: Sequence[Sequence[int]],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    what: str = "group",
) -> dist.ProcessGroup:
    """Make one group per row of ranks and return the one this rank is in.

    A collective: every rank of the world calls it with the same rows, in the same order. ``what`` names
    the groups in an error (e.g. ``"the mesh's group"``).

    Raises:
        ValueError: this rank is in no row, or in more than one.
        RuntimeError: torch could not make a row's group (the message names the ranks, the backend, the
            torch version and, for torch 2.11's gloo on a GPU, the fix).
    """
    rank = dist.get_rank()
    mine = [row for row in rows if rank in row]
    if len(mine) != 1:
        raise ValueError(f"member_group: rank {rank} is in {len(mine)} of the rows {rows}: expected exactly one")
    group: dist.ProcessGroup | None = None
    for row in rows:
        try:
            made = dist.new_group(list(row), backend=backend, timeout=timeout)
        except (AttributeError, RuntimeError) as e:
            raise RuntimeError(_failed(what, list(row), backend, e)) from e
        if rank in row:
            assert isinstance(made, dist.ProcessGroup)  # a member gets a group, not the sentinel
            add_abort_group(made)
            group = made
    assert group is not None  # checked above: this rank is in one row
    return group


def _failed(what: str, row: list[int], backend: str | None, error: BaseException) -> str:
    message = (
        f"could not make {what} of ranks {row} (backend {backend or dist.get_backend()}, torch {torch.__version__}): "
        f"{type(error).__name__}: {error}."
    )
    if "split" in str(error):
        message += (
            " Under torch 2.11, gloo cannot make subgroups of a default group bound to a GPU (Lightning binds it"
            " on GPUs). Fix: on GPUs pass process_group_backend='nccl', or use torch 2.14 (this package's pin, whose"
            " gloo supports splitting)."
        )
    return message
