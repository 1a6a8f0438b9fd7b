"""RPC's rendezvous store: rank 0 binds it on a kernel-picked port as it is chosen, so no other socket
can take the port between choosing and binding (the race of picking a free port first); the other
ranks connect to the port rank 0 shares, and RPC starts and stops over the store.

Everything runs in forked ranks: a TCP store or an RPC agent made in the pytest process would live
on in it (a store's server thread, distributed autograd's worker id) and hang or break the ranks
later tests fork from it.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_strategies.comm import rpc as ls_rpc
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc
from tests.dist_utils import run_workers

pytestmark = pytest.mark.slow  # two forked processes (~0.4 s)

TIMEOUT = timedelta(seconds=20)


def _meet(rank: int, world: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def share(port: int) -> int:
        if rank == 0:
            # what the other ranks are told is a port already bound and listening
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                    seen["bind_errno"] = 0
                except OSError as err:
                    seen["bind_errno"] = err.errno
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                seen["listening"] = True
        box = [port]
        dist.broadcast_object_list(box, src=0)
        seen["port"] = box[0]
        return int(box[0])

    store = rendezvous_store(rank, world, "127.0.0.1", timeout=TIMEOUT, share=share)
    store.set(f"from{rank}", str(rank))
    seen["peer"] = store.get(f"from{1 - rank}").decode()
    init_rpc(rank, world, store, timeout=TIMEOUT, num_threads=2)
    try:
        seen["rpc"] = rpc.rpc_sync(f"ps_worker{1 - rank}", max, args=(rank, 7))
        seen["kept"] = len(ls_rpc._STORES)  # kept while the agent may use it
    finally:
        shutdown_rpc(failed=False, timeout=TIMEOUT)
    seen["after"] = len(ls_rpc._STORES)
    return seen


def test_rank0_binds_the_port_it_shares_and_rpc_meets_there() -> None:
    r0, r1 = run_workers(_meet, 2, timeout=60)
    assert r0["bind_errno"] == errno.EADDRINUSE and r0["listening"]
    assert r0["port"] == r1["port"] > 0
    assert (r0["peer"], r1["peer"]) == ("1", "0")  # both ranks meet in rank 0's store
    assert r0["rpc"] == r1["rpc"] == 7
    assert r0["kept"] == r1["kept"] == 1 and r0["after"] == r1["after"] == 0
