"""``ParameterServerStrategy(align_pushes=...)``: the option's checks and where it decides to align, in one process
(the barrier itself on 2 processes: ``tests/integration/test_ps_overlap.py``; on the emulated 4 x 1 cluster:
``benchmarks/cluster_strategies.py``)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_strategies import AsyncParameterServerStrategy, ParameterServerStrategy
from lightning_strategies.strategies._ps_nodes import close_alignment, plan_alignment


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"align_pushes='yes'.*expected None .*True or False"):
        ParameterServerStrategy(align_pushes="yes")  # type: ignore[arg-type]
    for value in (None, True, False):
        assert ParameterServerStrategy(align_pushes=value).is_aligned is False  # decided at setup
    # async's workers step on their own schedules: nothing to align
    with pytest.raises(ValueError, match=r"AsyncParameterServerStrategy\(align_pushes=True\).*own schedules"):
        AsyncParameterServerStrategy(align_pushes=True)
    assert AsyncParameterServerStrategy(align_pushes=False).is_aligned is False


def _strategy(world_size: int, num_nodes: int) -> Any:
    return SimpleNamespace(world_size=world_size, num_nodes=num_nodes)


@pytest.mark.parametrize(
    ("option", "world", "nodes", "flat", "aligned"),
    [
        (None, 4, 4, True, True),  # the flat push across nodes (4 x 1): aligned
        (None, 4, 2, False, False),  # the hierarchical push (2 x 2): not by default
        (None, 4, 2, True, True),  # hierarchical=False on 2 x 2: flat across nodes
        (None, 2, 1, True, False),  # one node
        (True, 2, 1, True, True),
        (True, 4, 2, False, True),
        (True, 1, 1, True, False),  # one process: nobody to wait for
        (False, 4, 4, True, False),
    ],
)
def test_where_it_aligns(option: bool | None, world: int, nodes: int, flat: bool, aligned: bool) -> None:
    got = plan_alignment(_strategy(world, nodes), option, flat=flat, backend="gloo", timeout=None)
    assert (got is not None) is aligned
    if got is not None:
        assert got.group is None and not got.owned  # the default group is gloo: used as it is


def test_under_another_backend_it_makes_a_gloo_group_and_destroys_it(world_of_one: None) -> None:
    # the default group stands for an NCCL one: the barrier gets a gloo group of its own (host-side, no device sync)
    got = plan_alignment(_strategy(2, 2), None, flat=True, backend="nccl", timeout=timedelta(seconds=5))
    assert got is not None and got.owned and got.group is not None
    assert dist.get_backend(got.group) == "gloo"
    got()  # a barrier of the group's one process
    close_alignment(got)
    with pytest.raises(ValueError):  # destroyed: no longer a group of this process
        dist.get_backend(got.group)
