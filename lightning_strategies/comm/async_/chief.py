"""The chief's side of a run (the rank hosting the coordinator)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightning_strategies.comm.async_.queue import BatchQueue
from lightning_strategies.comm.async_.workers import WorkerState

__all__ = ["Chief"]


class Chief:
    """What the chief publishes to every worker, and its wait for an epoch to complete; guarded by the
    coordinator's lock (``progress`` is its condition).

    Attributes:
        lrs: the chief's learning rates, handed out with every lease (membership runs).
        published: scheduler states, buffers: for joining workers and the chief.
        stopped: the run is over: every refill is answered ``stop``.
        failure: why the run failed: every later request fails with it.
    """

    def __init__(self, progress: threading.Condition, queue: BatchQueue, workers: Mapping[int, WorkerState]) -> None:
        self._progress = progress
        self._queue = queue
        self._workers = workers
        self.lrs: list[float] | None = None
        self.published: dict[str, Any] = {}
        self.current: int | None = None
        self.stopped = False
        self.failure: str | None = None

    def wait_done(
        self, epoch: int, at_least: int, *, timeout: float, should_stop: Callable[[], bool] | None = None
    ) -> int:
        """Block until ``at_least`` batches of ``epoch`` are acked (see :meth:`AsyncCoordinator.wait_done`)."""
        deadline = None
        with self._progress:
            while True:
                known = self._queue.epochs.get(epoch)
                done = len(known.done) if known is not None else 0
                if known is not None and (done >= at_least or known.complete):
                    return done
                if self.failure is not None:
                    raise RuntimeError(f"async coordinator: {self.failure}")
                if any(w.alive for w in self._workers.values()):
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + timeout
                elif time.monotonic() > deadline:
                    lost = sorted(r for r, w in self._workers.items() if not w.alive)
                    raise TimeoutError(
                        f"async coordinator: every worker is gone ({lost} lost or finished) and none joined within "
                        f"{timeout:.0f}s, with {done} of {len(known.batches) if known else '?'} batches of epoch "
                        f"{epoch} done. Fix: restart the lost workers (they rejoin), or raise the strategy's `timeout`."
                    )
                if should_stop is not None and should_stop():
                    raise RuntimeError(f"async coordinator: told to stop while waiting for epoch {epoch}")
                self._progress.wait(0.25)
