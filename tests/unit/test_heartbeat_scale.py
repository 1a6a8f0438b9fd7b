"""How the heartbeat diagnosis talks to the store at 8 ranks: one ``multi_get`` per poll.

Ranks are :class:`Heartbeat` objects of one process, as in ``test_heartbeat.py`` (live peers beat
every 20 ms, a frozen one beat once); once they have started, the diagnosing rank's store (a
``PrefixStore`` over a real ``HashStore`` or ``TCPStore``) is wrapped in a :class:`CountingStore`,
which records each request before passing it on. At hundreds of
ranks a diagnosis that read each peer's keys one by one would send 2(P-1) requests per poll, from
every survivor at once; these tests hold it to one, and show that a slow store lengthens the grace
instead of making live peers look lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import lightning_strategies.comm.heartbeat as heartbeat
from lightning_strategies.comm.heartbeat import Heartbeat

WORLD = 8
LIVE_S = 0.02
FROZEN_S = 3600.0
GRACE_S = 1.0


class CountingStore:
    """Records every request as ``(method, keys, amount)`` and delegates it to ``inner`` (duck-typed).

    Args:
        inner: the real store.
        delay: seconds every request waits before it reaches ``inner`` (a loaded store).
    """

    def __init__(self, inner: dist.Store, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.calls: list[tuple[str, list[str], int | None]] = []

    def _record(self, method: str, keys: list[str], amount: int | None = None) -> None:
        self.calls.append((method, list(keys), amount))
        if self.delay:
            time.sleep(self.delay)

    def set(self, key: str, value: str | bytes) -> None:
        self._record("set", [key])
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._record("get", [key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._record("add", [key], amount)
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        self._record("check", keys)
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._record("multi_get", keys)
        return self.inner.multi_get(keys)

    def delete_key(self, key: str) -> bool:
        self._record("delete_key", [key])
        return self.inner.delete_key(key)

    def reads(self) -> list[tuple[str, list[str], int | None]]:
        """The requests that read peers' keys: everything but this rank's own beats and writes."""
        return [c for c in self.calls if c[0] in ("get", "check", "multi_get") or (c[0] == "add" and c[2] == 0)]


@pytest.fixture(params=["hash", "tcp"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[[], dist.Store]]:
    """Returns a new connection to one store per call: the ranks of a HashStore share it."""
    if request.param == "hash":
        store = dist.HashStore()
        yield lambda: store
        return
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False)


def _ranks(
    connect: Callable[[], dist.Store], intervals: dict[int, float], beats: list[Heartbeat]
) -> tuple[dict[int, Heartbeat], CountingStore]:
    """Rank 0 and the ranks of ``intervals`` start their heartbeats (the others never do); rank 0's
    store is then counted."""
    ranks = {}
    for rank, interval in {0: LIVE_S, **intervals}.items():
        ranks[rank] = Heartbeat(connect(), rank, WORLD, interval=interval, grace=GRACE_S).start()
        beats.append(ranks[rank])
    counting = CountingStore(ranks[0].store)
    ranks[0].store = counting  # type: ignore[assignment]
    return ranks, counting


def _count_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The diagnosis's sleeps between two polls (the heartbeat module's ``time.sleep`` only)."""
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    return sleeps


PEER_KEYS = [f"beat/{r}" for r in range(1, WORLD)] + [f"mark/{r}" for r in range(1, WORLD)]


def test_one_multi_get_per_poll_names_the_frozen_rank_and_no_live_one(
    connect: Callable[[], dist.Store], beats: list[Heartbeat], monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks, counting = _ranks(connect, {r: FROZEN_S if r == 5 else LIVE_S for r in range(1, WORLD)}, beats)
    sleeps = _count_sleeps(monkeypatch)
    counting.calls.clear()
    found = ranks[0].diagnose()
    assert found.lost == (5,) and found.gone == (5,) and found.failed == {} and found.store_error is None
    reads = counting.reads()
    assert reads[0][0] == "check" and sorted(reads[0][1]) == sorted(PEER_KEYS)  # all there: none read one by one
    polls = reads[1:]
    assert polls == [("multi_get", PEER_KEYS, None)] * len(polls)  # every peer's beat and mark, in one request
    assert len(polls) == len(sleeps) + 1 >= 4  # one request per poll; the frozen peer is watched for the grace
    assert found.waited >= GRACE_S


def test_a_rank_that_never_started_is_lost_and_only_its_keys_are_read_one_by_one(
    connect: Callable[[], dist.Store], beats: list[Heartbeat]
) -> None:
    ranks, counting = _ranks(connect, {r: LIVE_S for r in range(1, WORLD) if r != 6}, beats)
    counting.calls.clear()
    found = ranks[0].diagnose()
    assert found.lost == (6,) and found.gone == (6,)
    reads = counting.reads()
    # rank 6 is found by bisecting the peers with store.check (1 + 2 x 3 checks for 7 peers, not 14 requests),
    # then its keys are created with add(key, 0)
    checks = [c for c in reads if c[0] == "check"]
    assert 2 <= len(checks) <= 7, checks
    assert [c for c in reads if c[0] in ("add", "get")] == [("add", ["beat/6"], 0), ("add", ["mark/6"], 0)]
    assert {tuple(c[1]) for c in reads if c[0] == "multi_get"} == {tuple(PEER_KEYS)}


def test_marked_ranks_reasons_are_read_in_one_request(
    connect: Callable[[], dist.Store], beats: list[Heartbeat]
) -> None:
    ranks, counting = _ranks(connect, {r: LIVE_S for r in range(1, WORLD)}, beats)
    ranks[2].report_failure("ValueError: bad batch")
    ranks[4].report_failure("RuntimeError: out of memory")
    ranks[3].stop()
    counting.calls.clear()
    found = ranks[0].diagnose()
    assert found.failed == {2: "ValueError: bad batch", 4: "RuntimeError: out of memory"}
    assert found.finished == (3,) and found.lost == () and found.gone == (2, 3, 4)
    reasons = [c for c in counting.reads() if any(k.startswith("reason/") for k in c[1])]
    assert reasons == [("check", ["reason/2", "reason/4"], None), ("multi_get", ["reason/2", "reason/4"], None)]
    assert not [c for c in counting.reads() if c[0] in ("get", "add")]


def test_a_slow_store_lengthens_the_grace_instead_of_losing_live_peers(beats: list[Heartbeat]) -> None:
    """Every request waits 0.3 s (each beat too): with a grace of 2.5 intervals of 0.2 s alone, the
    second poll would end at ~0.65 s, and a live peer beating every ~0.5 s would look lost in most runs."""
    delay, interval = 0.3, 0.2
    store = dist.HashStore()
    ranks = [
        Heartbeat(store, r, WORLD, interval=FROZEN_S if r == 3 else interval).start()  # default grace: 0.5 s
        for r in range(WORLD)
    ]
    beats.extend(ranks)
    for beat in ranks:  # from here on every request of every rank, its beats included, is slow
        beat.store = CountingStore(beat.store, delay=delay)  # type: ignore[assignment]
    found = ranks[0].diagnose()
    assert found.lost == (3,) and found.gone == (3,) and found.store_error is None
    # the frozen peer was watched for grace + 4 polls of at least `delay` each
    assert found.waited >= 2.5 * interval + 4 * delay
