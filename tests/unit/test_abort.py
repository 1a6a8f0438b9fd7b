"""``abort_communication``'s view of this process's groups and of the store's port (the socket shutdown is in
``test_heartbeat_watch.py``), and the groups ``comm.groups`` makes for it."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from lightning_strategies.comm.abort import _GROUPS, _process_groups, _store_port
from lightning_strategies.comm.groups import member_group, new_group
from lightning_strategies.comm.peer_lost import PeerDiagnosis


def test_the_abort_reaches_the_default_group_and_every_group_made_here_while_it_lives() -> None:
    if dist.is_initialized():
        pytest.skip("a process group of another test is still initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made = [new_group([0]) for _ in range(5)]
        made.append(member_group([[0]], what="a test's group"))
        made += [new_group([0]) for _ in range(5)]  # twelve groups: creation order, not the names' text order
        outside = dist.new_group([0])  # made by torch directly: torch lists groups only privately
        assert _process_groups() == [dist.group.WORLD, *made]
        assert outside not in _process_groups()
        dist.destroy_process_group(made[3])
        assert _process_groups() == [dist.group.WORLD, *made[:3], *made[4:]]
        with pytest.raises(
            ValueError, match=r"member_group: rank 0 is in 0 of the rows \[\[1\]\]: expected exactly one"
        ):
            member_group([[1]])
        with pytest.raises(ValueError, match=r"rank 0 is in 2 of the rows"):
            member_group([[0], [0]])
    finally:
        dist.destroy_process_group()
    assert _process_groups() == []
    del made, outside
    gc.collect()
    assert all(ref() is None for ref in _GROUPS)  # the registry keeps no destroyed group alive


def test_the_store_port_comes_from_the_diagnosis_else_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _store_port(PeerDiagnosis(rank=0, world=2, store_host="10.0.0.1:4242")) == 4242
    assert _store_port(PeerDiagnosis(rank=0, world=2, store_host="")) == 29500
    assert _store_port(None) == 29500
    monkeypatch.delenv("MASTER_PORT")
    assert "MASTER_PORT" not in os.environ and _store_port(None) is None
