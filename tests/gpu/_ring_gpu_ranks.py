"""The ranks of ``test_ring_gpu.py``'s two-GPU runs (a module of its own: spawned processes import
their function by name)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_strategies.comm.heartbeat import PeerLostError, raise_peer_lost, start_heartbeat
from lightning_strategies.comm.ring import NodeLayout, hierarchical_all_reduce, ring_all_reduce

PG_TIMEOUT_S = 120.0
WATCH_GRACE_S = 3.0


def nccl_ring(rank: int, world: int) -> dict[str, Any]:
    """Per case, the flat and the hierarchical ring's largest error against NCCL's all-reduce, over
    the value scale, on this rank's GPU."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    nccl = dist.new_group(backend="nccl")
    intra = [dist.new_group([r], backend="nccl") for r in range(world)][rank]  # 2 "nodes" of 1 process
    found: dict[str, Any] = {}
    for numel in (1, 1001, 1 << 20):
        for wire in (None, torch.bfloat16):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank + numel)).to(device)
            ref = x.clone()
            dist.all_reduce(ref, group=nccl)
            flat, hier = x.clone(), x.clone()
            ring_all_reduce(flat, nccl, wire_dtype=wire, layout=NodeLayout.contiguous(world, 1))
            hierarchical_all_reduce(hier, intra, nccl, wire_dtype=wire)
            scale = float(ref.abs().max()) + 1.0
            found[f"{numel} {wire}"] = [float((y - ref).abs().max()) / scale for y in (flat, hier)]
    return found


def frozen_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 freezes after a first all-reduce; rank 0's second one must end in PeerLostError."""
    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl", timeout=timedelta(seconds=PG_TIMEOUT_S))
    beat = start_heartbeat(rank, world, watch_grace=WATCH_GRACE_S)
    assert beat is not None
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x, group=nccl)
    torch.cuda.synchronize()
    if rank == 1:
        beat.stop(finished=False)  # frozen: silent, never entering the next collective
        time.sleep(3 * WATCH_GRACE_S + 10)
        return {"victim": True}
    start = time.monotonic()
    try:
        with raise_peer_lost(lambda: beat, lambda: "ddp"):
            dist.all_reduce(x, group=nccl)
            torch.cuda.synchronize()  # where the host waits for the kernel the peer never joins
        return {"error": None, "seconds": time.monotonic() - start}
    except PeerLostError as exc:
        return {"error": str(exc), "ranks": list(exc.ranks), "seconds": time.monotonic() - start}
