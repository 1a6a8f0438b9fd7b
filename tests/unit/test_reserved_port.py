"""``reserved_port``: a port below the kernel's ephemeral range, never handed out twice, and under
pytest-xdist one no other worker can pick (each worker its own residue class)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import reserved_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.parametrize("worker", [0, 1, 2])
def test_each_xdist_worker_takes_only_its_own_ports(worker: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    ports = [reserved_port() for _ in range(30)]
    assert len(set(ports)) == len(ports)
    assert {p % 3 for p in ports} == {worker}
    assert all(1024 <= p < _ephemeral_low() for p in ports)


def test_without_xdist_every_port_of_the_range_can_be_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    ports = [reserved_port() for _ in range(60)]
    assert len(set(ports)) == len(ports)
    # 60 draws from ~12,000 ports, shuffled: all in one residue class mod 2 has probability 2^-59
    assert {p % 2 for p in ports} == {0, 1}


def test_a_single_worker_or_a_foreign_name_leaves_the_range_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    for worker, count in (("gw0", "1"), ("master", "2")):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
        assert {reserved_port() % 2 for _ in range(60)} == {0, 1}
