"""RPC's rendezvous store: rank 0 binds it on a kernel-picked port as it is chosen, so no other socket
can take the port between choosing and binding (the race of picking a free port first), and RPC
starts and stops over it; the multi-process path runs in tests/integration/test_ps_rpc.py."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed.rpc as rpc

from lightning_strategies.comm import rpc as ls_rpc
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc

TIMEOUT = timedelta(seconds=20)


def test_rank0_store_holds_its_port_from_the_moment_it_is_chosen() -> None:
    shared: list[int] = []

    def share(port: int) -> int:
        # what the other ranks learn: the port is already bound and listening when it is shared
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError) as info:
            s.bind(("127.0.0.1", port))
        assert info.value.errno == errno.EADDRINUSE
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        shared.append(port)
        return port

    store = rendezvous_store(0, 1, "127.0.0.1", timeout=TIMEOUT, share=share)
    assert shared == [store.port] and store.port > 0
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_a_client_rank_connects_to_the_port_rank0_shared() -> None:
    server = rendezvous_store(0, 2, "127.0.0.1", timeout=TIMEOUT, share=lambda port: port)
    client = rendezvous_store(1, 2, "127.0.0.1", timeout=TIMEOUT, share=lambda _: server.port)
    client.set("from_rank1", "1")
    assert server.get("from_rank1") == b"1"


def test_rpc_starts_over_the_store_and_releases_it_at_shutdown() -> None:
    store = rendezvous_store(0, 1, "127.0.0.1", timeout=TIMEOUT, share=lambda port: port)
    init_rpc(0, 1, store, timeout=TIMEOUT, num_threads=2)
    try:
        assert rpc.rpc_sync("ps_worker0", max, args=(3, 4)) == 4
        assert len(ls_rpc._STORES) == 1  # kept while the agent may use it
    finally:
        shutdown_rpc(failed=False, timeout=TIMEOUT)
    assert not ls_rpc._STORES
