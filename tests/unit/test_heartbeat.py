"""The heartbeat diagnosis of :mod:`lightning_strategies.comm.heartbeat` against real stores.

Ranks are :class:`Heartbeat` objects of one process sharing a ``HashStore`` (or a ``TCPStore``);
a *frozen* peer is a heartbeat whose interval is an hour: it beats once when it starts and never
again, as a SIGKILLed or SIGSTOPped process would. Live peers beat every 20 ms, so the
diagnosis (a grace of 1 s: 50 live intervals) tells them apart with a wide margin even on a
loaded machine; it returns as soon as every live peer has beaten, and waits the full grace
only for a frozen one.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist
from dist_utils import reserved_port, run_workers

from lightning_strategies.comm.heartbeat import (
    Heartbeat,
    PeerLostError,
    annotate_peer_failure,
    raise_peer_lost,
    start_heartbeat,
)

LIVE_S = 0.02
FROZEN_S = 3600.0
GRACE_S = 1.0


def _ranks(store: dist.Store, intervals: list[float], beats: list[Heartbeat]) -> list[Heartbeat]:
    world = len(intervals)
    for rank, interval in enumerate(intervals):
        beats.append(Heartbeat(store, rank, world, interval=interval, grace=GRACE_S, store_host="h:1").start())
    return beats


def test_a_frozen_peer_is_lost_and_named(beats: list[Heartbeat]) -> None:
    ranks = _ranks(dist.HashStore(), [LIVE_S, FROZEN_S, LIVE_S], beats)
    start = time.monotonic()
    found = ranks[0].diagnose()
    waited = time.monotonic() - start
    assert found.lost == (1,) and found.failed == {} and found.finished == () and found.gone == (1,)
    # the frozen peer is watched for the whole grace (a lower bound on a monotonic clock: exact);
    # the upper bound only says it ends, with room for a loaded machine's late wake-ups
    assert GRACE_S <= waited < GRACE_S + 20.0
    text = found.describe("ring")
    assert text is not None and text.startswith("ring: lost peer rank 1 of 3: no heartbeat for 1.0 s")
    assert "how rank 0 noticed" in text


def test_live_peers_are_not_named_and_the_diagnosis_returns_early(beats: list[Heartbeat]) -> None:
    ranks = _ranks(dist.HashStore(), [LIVE_S, LIVE_S, LIVE_S], beats)
    grace = 60.0  # returning early means well before this; a diagnosis that waits it out fails
    start = time.monotonic()
    found = ranks[2].diagnose(grace=grace)
    # both peers beat every 20 ms: the diagnosis returns at their next beats. A bound of half a
    # 1 s grace failed at load 21 (1.8 s); half of 60 s holds under any load seen here
    assert time.monotonic() - start < grace / 2
    assert found.gone == () and found.describe("ddp") is None


def test_a_peer_that_reported_its_error_is_named_with_it_not_lost(beats: list[Heartbeat]) -> None:
    ranks = _ranks(dist.HashStore(), [LIVE_S, LIVE_S, FROZEN_S], beats)
    ranks[1].report_failure("ValueError: bad batch")
    ranks[1].stop(finished=False)  # stops beating, as a failed rank does at teardown
    ranks[1].report_failure("RuntimeError: later")  # only the first report counts
    found = ranks[0].diagnose()
    assert found.failed == {1: "ValueError: bad batch"} and found.lost == (2,) and found.gone == (1, 2)
    text = found.describe("pipeline")
    assert text is not None
    assert "pipeline: lost peer rank 2 of 3:" in text
    assert "pipeline: peer rank 1 of 3 stopped on an error: ValueError: bad batch" in text
    assert "lost peer rank 1" not in text


def test_a_finished_peer_is_not_lost(beats: list[Heartbeat]) -> None:
    ranks = _ranks(dist.HashStore(), [LIVE_S, LIVE_S], beats)
    ranks[1].stop()
    found = ranks[0].diagnose()
    assert found.finished == (1,) and found.lost == () and found.failed == {}
    assert "peer rank(s) 1 of 2 had already finished" in (found.describe("ps") or "")


def test_a_restarted_run_forgets_the_marks_of_the_previous_one(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    first = _ranks(store, [LIVE_S, LIVE_S], [])
    first[1].stop()  # finished the previous fit
    first[0].stop()
    ranks = _ranks(store, [LIVE_S, FROZEN_S], beats)  # the same ranks, a new fit: rank 1 freezes
    assert ranks[0].diagnose().lost == (1,)


def _mark(store: dist.Store, rank: int) -> int:
    return int(store.add(f"lightning_strategies/peers/mark/{rank}", 0))


def test_the_store_host_ends_after_its_peers_have_marked_their_end(beats: list[Heartbeat]) -> None:
    """Rank 0 hosts the store: a peer still beating when its process exits gets "Connection reset by peer"
    (a C++ stack trace in a run that went well), so its clean stop returns only once every peer has said
    it finished, or after the grace. A peer marks after its last beat."""
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, LIVE_S, LIVE_S], beats)
    late = 0.3
    ranks[2].report_failure("ValueError: bad batch")  # a failed peer counts as ended
    peer = threading.Timer(late, ranks[1].stop)
    start = time.monotonic()  # before the timer's start: rank 1 marks at least `late` after it
    peer.start()
    ranks[0].stop()
    waited = time.monotonic() - start
    peer.join()
    # it returned after rank 1's mark (finished = 2), not before, and not at the end of the grace
    assert _mark(store, 1) == 2 and _mark(store, 2) == 1
    assert late <= waited < GRACE_S + 20.0
    beat = int(store.add("lightning_strategies/peers/beat/1", 0))
    time.sleep(10 * LIVE_S)
    assert int(store.add("lightning_strategies/peers/beat/1", 0)) == beat  # no beat after the mark


def test_the_store_host_waits_for_a_silent_peer_no_longer_than_the_grace(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = _ranks(store, [LIVE_S, FROZEN_S], beats)
    start = time.monotonic()
    ranks[0].stop()
    assert GRACE_S <= time.monotonic() - start < GRACE_S + 20.0
    assert _mark(store, 0) == 2 and _mark(store, 1) == 0


def test_a_peer_that_does_not_host_the_store_ends_without_waiting(beats: list[Heartbeat]) -> None:
    store = dist.HashStore()
    ranks = [Heartbeat(store, r, 2, interval=LIVE_S, grace=60.0).start() for r in range(2)]
    beats.extend(ranks)
    start = time.monotonic()
    ranks[1].stop()  # rank 0 still runs: a wait for it would last the 60 s grace
    assert time.monotonic() - start < 30.0 and _mark(store, 1) == 2


def _serve_store(write_fd: int) -> None:
    """In a forked child: host a TCPStore, tell its port, wait to be killed."""
    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(write_fd, str(store.port).encode())
        time.sleep(60)
    finally:
        os._exit(0)


@pytest.mark.parametrize("agent", [False, True], ids=["store-on-rank0", "store-on-torchrun-agent"])
def test_an_unreachable_store_names_its_host_rank(agent: bool, beats: list[Heartbeat]) -> None:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        _serve_store(write_fd)
    try:
        port = int(os.read(read_fd, 16))
        timeout = datetime.timedelta(seconds=5)
        clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) for _ in range(2)]
        for rank, client in enumerate(clients):
            host = f"127.0.0.1:{port}"
            beat = Heartbeat(client, rank, 2, interval=LIVE_S, grace=GRACE_S, store_host=host,
                             store_rank=None if agent else 0)  # fmt: skip
            beats.append(beat.start())
    finally:
        os.kill(pid, signal.SIGKILL)  # the store's host dies
        os.waitpid(pid, 0)
        os.close(read_fd)
        os.close(write_fd)
    found = beats[1].diagnose()
    assert found.store_error is not None and found.lost == ()
    text = found.describe("async") or ""
    if agent:
        assert found.gone == () and "hosted by torchrun's agent on node 0" in text and "lost peer" not in text
    else:
        assert found.gone == (0,)
        assert text.startswith(f"async: lost peer rank 0 of 2: it hosts the store at 127.0.0.1:{port}")


def test_annotate_adds_the_diagnosis_once_and_reports_this_rank(beats: list[Heartbeat]) -> None:
    ranks = _ranks(dist.HashStore(), [LIVE_S, FROZEN_S], beats)
    err = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    annotate_peer_failure(err, ranks[0], "ddp")
    annotate_peer_failure(err, ranks[0], "ddp")  # a second hook on the same exception adds nothing
    assert len(err.__notes__) == 1 and err.__notes__[0].startswith("ddp: lost peer rank 1 of 2:")
    # rank 0 told the others why it stops
    assert ranks[1].diagnose(grace=0.0).failed == {0: "RuntimeError: Connection closed by peer [127.0.0.1]:4242"}
    plain = ValueError("no heartbeat, no note")
    annotate_peer_failure(plain, None, "ddp")
    annotate_peer_failure(KeyboardInterrupt(), ranks[0], "ddp")  # not an Exception: left alone
    assert not hasattr(plain, "__notes__")


def test_a_failed_step_raises_peer_lost_error_only_when_a_peer_is_gone(beats: list[Heartbeat]) -> None:
    lost_ranks = _ranks(dist.HashStore(), [LIVE_S, FROZEN_S], beats)
    cause = RuntimeError("gloo: Connection reset by peer")
    with pytest.raises(PeerLostError) as info, raise_peer_lost(lambda: lost_ranks[0], lambda: "ring"):
        raise cause
    err = info.value
    assert err.ranks == (1,) and err.strategy == "ring" and err.__cause__ is cause
    assert str(err).startswith("ring: lost peer rank 1 of 2:") and err.diagnosis.lost == (1,)
    annotate_peer_failure(err, lost_ranks[0], "ring")  # Lightning's on_exception: already diagnosed
    assert not hasattr(err, "__notes__")

    alive = _ranks(dist.HashStore(), [LIVE_S, LIVE_S], [])
    beats.extend(alive)
    local = ValueError("a bug in training_step")
    with pytest.raises(ValueError) as plain, raise_peer_lost(lambda: alive[0], lambda: "ring"):
        raise local
    assert plain.value is local  # every peer alive: the original error, unchanged


def _beat_into_the_groups_store(rank: int, world: int) -> dict[str, object]:
    """A rank of a real 2-rank group (``run_workers`` sets ``MASTER_ADDR``/``MASTER_PORT``, as Lightning does)."""
    port = int(os.environ["MASTER_PORT"])
    reader = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    short = datetime.timedelta(seconds=0.5)
    out: dict[str, object] = {"port": port}
    for attempt, address in [(0, None), (2, ("127.0.0.1", port))]:  # from the environment, then given
        if attempt:
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)  # torchrun's count of restarts
        beat = start_heartbeat(rank, world, store_address=address, interval=LIVE_S, store_timeout=short, watch_grace=0)
        assert beat is not None
        try:
            start = time.monotonic()
            try:
                beat.store.get("never-set")
            except dist.DistStoreError:
                out[f"request_s_{attempt}"] = time.monotonic() - start  # store_timeout, not the connect's 60 s
            key = f"process_group/attempt_{attempt}/lightning_strategies/peers/beat/{rank}"
            first = reader.add(key, 0)
            time.sleep(20 * LIVE_S)
            out[f"beats_{attempt}"] = [first, reader.add(key, 0)]  # its own connection, this attempt's keys
            out[f"lost_{attempt}"] = list(beat.diagnose(grace=2.0).lost)
            out[f"host_{attempt}"] = (beat.store_host, beat.store_rank)
        finally:
            beat.stop()
        dist.barrier()  # both stopped before the next attempt's heartbeat
    del os.environ["MASTER_ADDR"]
    out["without_address"] = start_heartbeat(rank, world) is None  # logged, no heartbeat
    return out


def test_start_heartbeat_beats_into_the_groups_store_under_the_attempts_prefix() -> None:
    results = run_workers(_beat_into_the_groups_store, 2, timeout=90)
    for rank in (0, 1):
        out = results[rank]
        for attempt in (0, 2):
            # the group's store, and rank 0 hosts it (no torchrun agent)
            assert out[f"host_{attempt}"] == (f"127.0.0.1:{out['port']}", 0), out
            first, later = out[f"beats_{attempt}"]
            assert later > first >= 1, (rank, attempt, out)
            assert out[f"lost_{attempt}"] == [], (rank, attempt, out)  # both alive: nobody lost
            assert out[f"request_s_{attempt}"] < 5, out
        assert out["without_address"] is True


def test_no_heartbeat_without_a_group_or_in_a_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert start_heartbeat(0, 2) is None  # no process group
    # a port nobody listens on: a heartbeat that tried it would wait the connect's 60 s
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(reserved_port()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        start = time.monotonic()
        assert start_heartbeat(0, 1) is None  # nobody to watch
        # ft, local_sgd, diloco and async_elastic keep a default group of one while Lightning's world is larger
        assert start_heartbeat(0, 2) is None
        assert time.monotonic() - start < 5
    finally:
        dist.destroy_process_group()
