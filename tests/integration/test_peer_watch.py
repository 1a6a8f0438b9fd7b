"""A frozen peer no longer holds a collective for the whole process-group timeout: the heartbeat's
watch aborts the survivors' communication (``abort_communication``) and each ends with a
``PeerLostError`` naming the lost rank.

gloo, fork-started processes (``run_workers``), a process-group timeout of ``PG_TIMEOUT_S`` (60 s)
and a watch grace of ``WATCH_GRACE_S`` (2 s). The victim joins a first all-reduce, then stops its
heartbeat without a word and sleeps with its sockets open, never entering the second collective:
from outside it is a frozen (SIGSTOPped) process. Without the watch the survivors would wait the
60 s timeout (``test_ring_faults.py`` shows that wait at a short timeout); with it they fail after
about the watch's grace plus the diagnosis's (2 + 2.5 s). Cases: gloo's own all-reduce (the path
of DDP, the pipeline's and tensor parallelism's collectives), our ring's point-to-point messages,
and 3 ranks, where rank 2 does not watch the victim (it watches rank 0) and learns of the loss
from the alarm or from rank 0's connections ending.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

from lightning_strategies.comm import ring_all_reduce
from lightning_strategies.comm.heartbeat import PeerLostError, raise_peer_lost, start_heartbeat

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 60.0
WATCH_GRACE_S = 2.0
VICTIM = 1


def _worker(rank: int, world: int, op: str, out_dir: str) -> dict[str, Any]:
    beat = start_heartbeat(rank, world, watch_grace=WATCH_GRACE_S)
    assert beat is not None
    x = torch.ones(2**16)
    dist.all_reduce(x)  # everyone is in, every connection up
    done = [Path(out_dir, f"done{r}") for r in range(world) if r != VICTIM]
    if rank == VICTIM:
        beat.stop(finished=False)  # silent, sockets open
        deadline = time.monotonic() + 2 * PG_TIMEOUT_S
        while not all(p.exists() for p in done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"victim": True}
    start = time.monotonic()
    result: dict[str, Any] = {"error": None}
    try:
        with raise_peer_lost(lambda: beat, lambda: "ddp"):
            if op == "ring":
                ring_all_reduce(x, check_peers=False)
            else:
                dist.all_reduce(x)
    except PeerLostError as exc:
        result = {"error": str(exc), "ranks": list(exc.ranks), "cause": type(exc.__cause__).__name__,
                  "watch_found": beat.found is not None}  # fmt: skip
    result["seconds"] = time.monotonic() - start
    Path(out_dir, f"done{rank}").touch()
    # Stay until every survivor has its answer, as a failing training process takes a while to
    # exit: rank 0 hosts the store, and a store gone mid-diagnosis is a diagnosis of its own.
    deadline = time.monotonic() + PG_TIMEOUT_S
    while not all(p.exists() for p in done) and time.monotonic() < deadline:
        time.sleep(0.05)
    beat.stop(finished=False)
    return result


@pytest.mark.parametrize(("world", "op"), [(2, "all_reduce"), (2, "ring"), (3, "all_reduce")])
def test_watch_ends_a_collective_held_by_a_frozen_peer(world: int, op: str, tmp_path: Path) -> None:
    found = run_workers(_worker, world, op, str(tmp_path), timeout=2 * PG_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
    context = json.dumps(found, indent=1)
    for rank, result in enumerate(found):
        if rank == VICTIM:
            continue
        assert result["error"] is not None, context
        assert f"ddp: lost peer rank {VICTIM} of {world}:" in result["error"], context
        lines = re.findall(r"ddp: lost peer ranks? ([\d, ]+) of", result["error"])
        named = {int(n) for line in lines for n in line.split(",")}
        assert named == {VICTIM}, context  # no survivor named lost (one that failed first: "stopped on an error")
        assert VICTIM in result["ranks"], context
        # the blocked operation failed because its connections were shut down, not by a timeout
        assert result["cause"] in ("RuntimeError", "RingPeerError", "DistBackendError"), context
        assert "Timed out" not in result["error"], context
        assert result["seconds"] < PG_TIMEOUT_S, context  # the watch, not the process group, ended it
    assert found[0]["watch_found"], context  # rank 0 watches the victim: its watch acted
