"""``abort_communication``'s view of this process's groups (the socket shutdown is in ``test_heartbeat_watch.py``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_strategies.comm.abort import _process_groups


def test_process_groups_come_in_creation_order_past_ten_groups() -> None:
    if dist.is_initialized():
        pytest.skip("a process group of another test is still initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        created = [dist.new_group([0]) for _ in range(11)]  # named "1" .. "11": "10" sorts before "2" as text
        assert _process_groups() == [dist.group.WORLD, *created]
    finally:
        dist.destroy_process_group()
