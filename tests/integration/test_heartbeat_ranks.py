"""8 processes keep heartbeats in one TCPStore; one is SIGKILLed; every survivor names exactly it.

No training: each rank only beats and, once the victim is gone, diagnoses (``_heartbeat_ranks``).
The 7 survivors diagnose at the same time, each reading all peers' beats and marks in one store
request per poll. The ranks are forked from a pre-imported zygote (``fault_utils``), which kills
a rank that outlives ``JOB_TIMEOUT_S`` and, at the end, its whole session (ours alone).

Each survivor must name the victim, and only it, as lost (no live peer, no store error), within
the grace (2.5 s at the default 1 s interval) + ``SLACK_S`` of the victim's death.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_utils import reserved_port
from fault_utils import Job, Zygote

from lightning_strategies.comm.heartbeat import DEFAULT_INTERVAL, GRACE_INTERVALS

pytestmark = pytest.mark.slow

WORLD = 8
VICTIM = 5  # not rank 0: it hosts the store (test_heartbeat.py covers a lost store)
GRACE_S = GRACE_INTERVALS * DEFAULT_INTERVAL
SLACK_S = 3.0  # noticing the death (10 ms polls), the settle pause, scheduling 8 processes on a loaded machine
JOB_TIMEOUT_S = 45.0


def test_every_survivor_names_the_sigkilled_rank_and_no_other(tmp_path: Path) -> None:
    zygote = Zygote(["_heartbeat_ranks"], tmp_path / "zygote.log")
    try:
        kwargs = {"port": reserved_port(), "victim": VICTIM, "interval": DEFAULT_INTERVAL, "out_dir": str(tmp_path)}
        answer = zygote.run(Job("_heartbeat_ranks:run_rank", WORLD, {}, kwargs, tmp_path, timeout=JOB_TIMEOUT_S))
        left = zygote.leftovers()
    finally:
        zygote.close()
    assert left == [] and zygote.leftovers() == [], "processes left in the zygote's session"
    ranks = answer["ranks"]
    logs = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(WORLD)}
    context = "\n".join(f"--- rank {r} (exit {ranks[r]['returncode']}):\n{logs[r][-3000:]}" for r in logs)
    assert answer["timed_out"] == [], f"ranks {answer['timed_out']} hung and were killed\n{context}"
    killed = json.loads((tmp_path / "killed.json").read_text())
    assert killed["rank"] == VICTIM and ranks[VICTIM]["returncode"] == -9, context
    for r in (r for r in range(WORLD) if r != VICTIM):
        assert ranks[r]["returncode"] == 0, context
        found = json.loads((tmp_path / f"rank{r}.json").read_text())
        named_after = found["time"] - killed["time"]
        print(f"rank {r}: named {found['lost']} after {named_after:.2f} s (watched {found['waited']:.2f} s)")
        assert found["lost"] == [VICTIM] and found["gone"] == [VICTIM], (r, found)
        assert found["failed"] == {} and found["finished"] == [] and found["store_error"] is None, (r, found)
        assert found["text"].startswith(f"heartbeat: lost peer rank {VICTIM} of {WORLD}: no heartbeat for"), found
        assert found["waited"] >= GRACE_S and named_after < GRACE_S + SLACK_S, (r, found, named_after)
    print(f"{WORLD} ranks: case took {answer['wall_s']:.1f} s")
