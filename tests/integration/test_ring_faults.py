"""A peer that dies or hangs mid-reduce makes the others fail with the lost rank named,
within the process-group timeout, instead of hanging."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_workers

import lightning_strategies.comm.ring.transport as ring_module
from lightning_strategies.comm import RingPeerError, ring_all_reduce

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 20.0
HUNG_PG_TIMEOUT_S = 3.0


def _fault_worker(rank: int, world: int, victim: int, fault: str, out_dir: str) -> None:
    if rank == victim:

        def fail_after_first_step(dst: torch.Tensor, src: torch.Tensor) -> None:
            # Reached once the first ring step's message has arrived: the ring is mid-reduce.
            if fault == "hang":
                time.sleep(HUNG_PG_TIMEOUT_S + 2)  # alive and silent past the others' timeout
            os._exit(1)

        # Forked process: the patch lives in the victim only.
        ring_module._reduce_segment = fail_after_first_step  # type: ignore[assignment]
    start = time.monotonic()
    result: dict[str, Any] = {"rank": rank}
    try:
        ring_all_reduce(torch.ones(2**18), check_peers=False)
        result["error"] = None
    except RingPeerError as exc:
        result.update(error=str(exc), peer=exc.peer, type="RingPeerError")
    except Exception as exc:  # pragma: no cover - reported by the assertion below
        result.update(error=repr(exc), peer=None, type=type(exc).__name__)
    result["seconds"] = time.monotonic() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(world: int, fault: str, pg_timeout_s: float, tmp_path: Path) -> dict[int, dict[str, Any]]:
    with pytest.raises(RuntimeError, match="rank 1 failed:\nprocess exited with code 1"):
        run_workers(_fault_worker, world, 1, fault, str(tmp_path), timeout=60, pg_timeout_s=pg_timeout_s)
    found = {}
    for rank in range(world):
        if rank != 1:
            found[rank] = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
    return found


@pytest.mark.parametrize("world", [2, 3])
def test_dead_peer_is_named_by_the_ranks_it_leaves_behind(world: int, tmp_path: Path) -> None:
    found = _run(world, "exit", PG_TIMEOUT_S, tmp_path)
    # The successor of the dead rank receives from it and names it. With P=3, rank 0 waits on
    # rank 2, which stops on its own error: the ring passes the failure on, and rank 0 names
    # the neighbour it lost (rank 1 through its send, or rank 2 through its receive).
    successor = 2 % world
    assert found[successor]["type"] == "RingPeerError", found
    assert found[successor]["peer"] == 1, found
    assert "peer rank 1" in found[successor]["error"], found
    for res in found.values():
        assert res["type"] == "RingPeerError", found
        assert res["peer"] in (1, 2), found
        assert res["seconds"] < PG_TIMEOUT_S, found  # a closed connection, not a timeout


def test_hung_peer_fails_the_others_at_the_process_group_timeout(tmp_path: Path) -> None:
    found = _run(2, "hang", HUNG_PG_TIMEOUT_S, tmp_path)
    res = found[0]
    assert res["type"] == "RingPeerError" and res["peer"] == 1, found
    assert "peer rank 1" in res["error"] and "Timed out" in res["error"], found
    assert HUNG_PG_TIMEOUT_S * 0.9 <= res["seconds"] < HUNG_PG_TIMEOUT_S + 5, found
