"""The heartbeat's watch (``Heartbeat.watch``) on a real store, and ``abort_communication``'s
socket shutdown, in one process.

Ranks are :class:`Heartbeat` objects sharing a ``HashStore``; a *frozen* peer beats once and never
again (an interval of an hour), as a SIGSTOPped process. Live peers beat every 20 ms, the watch's
grace is 0.4 s (20 live intervals) and the diagnosis's 0.5 s, so live and frozen are told apart
with a wide margin on a loaded machine. Waits for a callback are bounded (``WAIT_S``); no test
asserts a duration.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_strategies.comm.heartbeat import Heartbeat, PeerDiagnosis, PeerLostError, raise_peer_lost

LIVE_S = 0.02
FROZEN_S = 3600.0
SLOW_S = 1.0  # a peer that beats, but less often than the watch's grace
DIAGNOSIS_GRACE_S = 0.5
WATCH_GRACE_S = 0.4
WAIT_S = 20.0
REPO = Path(__file__).resolve().parents[2]


class Calls:
    """What the watch's ``on_lost`` received, with an event to wait on."""

    def __init__(self) -> None:
        self.found: list[PeerDiagnosis] = []
        self.event = threading.Event()

    def __call__(self, diagnosis: PeerDiagnosis) -> None:
        self.found.append(diagnosis)
        self.event.set()


def _ranks(store: dist.Store, intervals: list[float], beats: list[Heartbeat]) -> list[Heartbeat]:
    world = len(intervals)
    for rank, interval in enumerate(intervals):
        beat = Heartbeat(store, rank, world, interval=interval, grace=DIAGNOSIS_GRACE_S, store_host="h:1")
        beats.append(beat.start())
    return beats


def _watch(beat: Heartbeat) -> Calls:
    calls = Calls()
    beat.watch(calls, grace=WATCH_GRACE_S)
    return calls


def _alarms(store: dist.Store) -> int:
    return int(dist.PrefixStore("lightning_strategies/peers", store).add("alarm", 0))


def test_a_frozen_peer_is_found_by_its_watcher_and_by_the_others_through_the_alarm(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, FROZEN_S, LIVE_S], beats)
    watcher, other = _watch(ranks[0]), _watch(ranks[2])  # rank 0 watches 1; rank 2 watches 0 (alive)
    assert watcher.event.wait(WAIT_S) and other.event.wait(WAIT_S)
    for calls, beat in ((watcher, ranks[0]), (other, ranks[2])):
        assert len(calls.found) == 1  # once
        assert calls.found[0].lost == (1,) and calls.found[0].failed == {}, calls.found
        assert beat.found is calls.found[0]
    assert _alarms(store) == 1  # raised by rank 0 only; rank 2 learned it from the counter


def test_live_peers_raise_no_alarm(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, LIVE_S, LIVE_S], beats)
    watches = [_watch(beat) for beat in ranks]
    time.sleep(5 * WATCH_GRACE_S)
    assert not any(w.event.is_set() for w in watches) and _alarms(store) == 0
    assert all(beat.found is None for beat in ranks)


def test_a_finished_peer_is_skipped_for_the_next(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, LIVE_S, FROZEN_S], beats)
    ranks[1].stop()  # finished: silent from now on, but not lost
    watcher = _watch(ranks[0])
    assert watcher.event.wait(WAIT_S)
    assert watcher.found[0].lost == (2,) and watcher.found[0].finished == (1,), watcher.found


def test_a_peer_marked_failed_is_acted_on_after_the_grace(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, LIVE_S], beats)
    watcher = _watch(ranks[0])
    ranks[1].report_failure("RuntimeError: stuck in teardown")  # still beating: only its mark says it
    assert watcher.event.wait(WAIT_S)
    assert watcher.found[0].failed == {1: "RuntimeError: stuck in teardown"} and watcher.found[0].lost == ()


def test_a_slow_but_beating_peer_is_diagnosed_alive_and_watched_on(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    # rank 1 beats every 1 s: silent past the watch's 0.4 s, so the alarm goes off, but the
    # confirming diagnosis (grace 0.5 s, plus 4 polls) sees it beat at least once in most rounds
    ranks = [Heartbeat(store, r, 2, interval=i, grace=2.5 * SLOW_S, store_host="h:1") for r, i in
             enumerate([LIVE_S, SLOW_S])]  # fmt: skip
    beats.extend(beat.start() for beat in ranks)
    watcher = _watch(ranks[0])
    deadline = time.monotonic() + WAIT_S
    while _alarms(store) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alarms(store) >= 2  # it raised the alarm, found the peer alive, and kept watching
    assert not watcher.event.is_set() and ranks[0].found is None


def test_the_watch_ends_when_this_rank_reports_its_own_failure(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, FROZEN_S], beats)
    ranks[0].report_failure("ValueError: bad batch")  # its own error path diagnoses from here
    watcher = _watch(ranks[0])
    time.sleep(5 * WATCH_GRACE_S)
    assert not watcher.event.is_set() and _alarms(store) == 0


def test_raise_peer_lost_uses_the_watchs_diagnosis_and_raises_after_a_clean_block(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, FROZEN_S], beats)
    watcher = _watch(ranks[0])
    assert watcher.event.wait(WAIT_S)

    def no_second_diagnosis(*args: object, **kwargs: object) -> PeerDiagnosis:
        raise AssertionError("the watch's diagnosis should have been used")

    ranks[0].diagnose = no_second_diagnosis  # type: ignore[method-assign]
    # a block that returned (NCCL: an aborted operation may return garbage) still fails the step
    with pytest.raises(PeerLostError, match=r"ring: lost peer rank 1 of 2") as clean, raise_peer_lost(
        lambda: ranks[0], lambda: "ring"
    ):
        pass
    assert clean.value.ranks == (1,) and clean.value.diagnosis is watcher.found[0]
    with pytest.raises(PeerLostError, match=r"ddp: lost peer rank 1 of 2") as failed, raise_peer_lost(
        lambda: ranks[0], lambda: "ddp"
    ):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    assert isinstance(failed.value.__cause__, RuntimeError)


def test_watch_refuses_a_grace_that_is_not_positive(beats: list[Heartbeat]) -> None:
    (beat,) = _ranks(dist.HashStore(), [LIVE_S], beats)
    with pytest.raises(ValueError, match=r"watch\(grace=0\): expected a positive number of seconds"):
        beat.watch(Calls(), grace=0)


# In a fresh interpreter: shutting down "every TCP connection of this process" must not touch the
# test process's own (nor, through a fork, its parent's: that is the function's other rule).
SHUTDOWN_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, socket, sys
    # the module alone (stdlib and torch.distributed), not the package, which imports Lightning
    spec = importlib.util.spec_from_file_location("abort", "lightning_strategies/comm/abort.py")
    abort = importlib.util.module_from_spec(spec)
    sys.modules["abort"] = abort
    spec.loader.exec_module(abort)
    _shutdown_tcp_connections = abort._shutdown_tcp_connections

    def pair():
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        return server, client, accepted

    kept_server, kept_client, kept_accepted = pair()
    gone_server, gone_client, gone_accepted = pair()
    count = _shutdown_tcp_connections({kept_server.getsockname()[1]})
    kept_client.sendall(b"ok")
    gone_client.settimeout(5)
    result = {"count": count, "kept": kept_accepted.recv(2).decode(), "gone": gone_client.recv(10).decode()}
    try:
        gone_client.sendall(b"x")
        result["send_after"] = "sent"
    except OSError as err:
        result["send_after"] = type(err).__name__
    probe = socket.create_connection(gone_server.getsockname())  # the listener still accepts
    result["listener"] = gone_server.accept()[0] is not None
    print(json.dumps(result))
    """
)


def test_shutdown_ends_every_connection_but_the_kept_ports() -> None:
    proc = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the two ends of the other connection (client and accepted), not the kept pair nor listeners
    assert result["count"] == 2, result
    assert result["kept"] == "ok", result  # the store's connection keeps working
    assert result["gone"] == "", result  # EOF: what gloo sees as "connection closed by peer"
    assert result["send_after"] == "BrokenPipeError", result
    assert result["listener"] is True, result
