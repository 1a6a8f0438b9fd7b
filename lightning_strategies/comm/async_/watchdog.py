"""One thread for every held request's deadline, instead of a timer per request."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.futures import Future

from lightning_strategies.comm.async_.workers import Held

__all__ = ["DeadlineWatchdog", "deliver"]


def deliver(ready: Sequence[tuple[Future[Any], Any]]) -> None:
    """Set each future's value; call outside the coordinator's lock: a future's callbacks
    serialise the RPC reply inline."""
    for fut, value in ready:
        if not fut.done():
            fut.set_result(value)


class DeadlineWatchdog:
    """Fails each held request still waiting at its deadline with ``expire(held)``'s answers.
    ``lock`` is the coordinator's: :meth:`watch`, :meth:`close` and ``expire`` run holding it."""

    def __init__(self, lock: threading.Lock, expire: Callable[[Held], list[tuple[Future[Any], Any]]]) -> None:
        self._lock = lock
        self._wake = threading.Condition(lock)
        self._expire = expire
        self._deadlines: list[tuple[float, int, Held]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, held: Held) -> None:
        """Fail ``held`` at its deadline unless it is answered first (holding the lock)."""
        heapq.heappush(self._deadlines, (held.deadline, next(self._seq), held))
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="async-coordinator-watchdog", daemon=True)
            self._thread.start()
        self._wake.notify()

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                while self._deadlines and self._deadlines[0][2].done:
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._wake.wait()
                    continue
                wait = self._deadlines[0][0] - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                _, _, held = heapq.heappop(self._deadlines)
                if held.done:
                    continue
                ready = self._expire(held)
                self._lock.release()
                try:
                    deliver(ready)
                finally:
                    self._lock.acquire()

    def close(self) -> threading.Thread | None:
        """Stop the thread (holding the lock); returns it, for the caller to join outside the lock."""
        self._closed = True
        self._wake.notify_all()
        thread, self._thread = self._thread, None
        return thread
