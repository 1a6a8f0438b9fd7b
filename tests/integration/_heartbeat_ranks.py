"""What one rank of ``test_heartbeat_ranks`` runs: a heartbeat in a shared TCPStore, no training.

Rank 0 hosts the ``TCPStore``; every rank starts its :class:`Heartbeat` on a connection of its own
with the heartbeat's short timeout (as :func:`start_heartbeat` does) and waits for the others.
Then the victim writes ``killed.json`` (its rank, pid and ``time.time()``) and SIGKILLs itself, its
heartbeat thread still running: no mark, no handler. Each survivor waits until the victim's
process is gone, diagnoses, and writes ``rank<r>.json`` (the diagnosis and ``time.time()`` at its
end). No survivor stops its heartbeat (which marks it finished) before every survivor has
diagnosed, and rank 0, the store's host, leaves last. Every wait is bounded by ``DEADLINE_S``.

The ranks load ``lightning_strategies/comm/heartbeat.py`` by its path, not through the package,
whose ``__init__`` imports Lightning: ~15 s more for the zygote on a loaded 2-vCPU machine, for
nothing, since the module needs torch.distributed alone (``comm/`` is Lightning-free).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

_SOURCE = Path(__file__).resolve().parents[2] / "lightning_strategies" / "comm" / "heartbeat.py"
_spec = importlib.util.spec_from_file_location("_heartbeat_alone", _SOURCE)
assert _spec is not None and _spec.loader is not None
heartbeat = sys.modules["_heartbeat_alone"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(heartbeat)

DEADLINE_S = 30.0  # each wait below: a rank stuck in one fails with a message before the job timeout kills it
SETTLE_S = 0.2  # lets the store serve a beat the victim may have sent just before it died


def _barrier(store: dist.Store, name: str, count: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + DEADLINE_S
    while store.add(name, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r}: {store.add(name, 0)} of {count} ranks after {DEADLINE_S} s")
        time.sleep(0.01)


def _wait_gone(pid: int) -> None:
    """Until ``pid`` has exited (a zombie, or reaped by the zygote)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the victim (pid {pid}) still runs after {DEADLINE_S} s")
        time.sleep(0.01)


def run_rank(rank: int, world: int, *, port: int, victim: int, interval: float, out_dir: str) -> None:
    out = Path(out_dir)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=DEADLINE_S)
    )
    own = store.clone()  # the heartbeat's own connection, with its short timeout
    own.set_timeout(heartbeat.DEFAULT_STORE_TIMEOUT)
    beat = heartbeat.Heartbeat(own, rank, world, interval=interval, store_host=f"127.0.0.1:{port}").start()
    _barrier(store, "started", world)
    if rank == victim:
        (out / "killed.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time()}))
        store.set("victim_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_gone(int(store.get("victim_pid")))
    time.sleep(SETTLE_S)
    found = beat.diagnose()
    record = {
        "lost": found.lost,
        "failed": found.failed,
        "finished": found.finished,
        "gone": found.gone,
        "store_error": found.store_error,
        "waited": found.waited,
        "grace": beat.grace,
        "time": time.time(),
        "text": found.describe("heartbeat"),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    _barrier(store, "diagnosed", world - 1)
    beat.stop()
    if rank == 0:
        _barrier(store, "left", world - 1)  # the store's host leaves last
    else:
        store.add("left", 1)
