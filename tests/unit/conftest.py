"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

import lightning_strategies.optim._foreach as foreach_module
from lightning_strategies.comm.heartbeat import Heartbeat

# The optimizers' update paths: per tensor; multi-tensor; multi-tensor with CPU cache blocking
# cut down to 8 elements, so (1,) and (7,) run as one unit of whole tensors and (5, 3) and
# (4, 3, 3, 3) are cut into chunks (with the default block no tensor of the tests is).
PATHS = ["per_tensor", "foreach", "foreach_blocked"]


@pytest.fixture(params=PATHS)
def foreach(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True for the multi-tensor paths; the blocked one shrinks the CPU cache block to 8 elements."""
    if request.param == "foreach_blocked":
        monkeypatch.setattr(foreach_module, "CPU_BLOCK_ELEMENTS", 8)
    return request.param != "per_tensor"


@pytest.fixture
def beats() -> Iterator[list[Heartbeat]]:
    """The heartbeats a test starts (append them); stopped, as unfinished, when it ends."""
    started: list[Heartbeat] = []
    yield started
    for beat in started:
        beat.stop(finished=False)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-process gloo group in the test process (a HashStore, no port), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
