"""What the emulated cluster's RPC probes share (``_exchange.py``, ``_latency.py``): a torchrun rank's gloo
process group and RPC agent, set up as ``comm.rpc.init_rpc`` sets them up and ended in order."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc


@contextlib.contextmanager
def gloo_and_rpc(timeout: timedelta) -> Iterator[tuple[int, int]]:
    """This torchrun rank's ``(rank, world)`` inside its gloo process group and RPC agent; on the way out (not
    on an exception: the rank's death is what the launcher reports) every rank meets in a barrier, then RPC and
    the group end."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timeout)
    store = rendezvous_store(rank, world, os.environ["MASTER_ADDR"], timeout=timeout)
    init_rpc(rank, world, store, timeout=timeout)
    yield rank, world
    dist.barrier()
    shutdown_rpc(failed=False, timeout=timeout)
    dist.destroy_process_group()
