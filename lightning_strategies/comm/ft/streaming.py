"""The outer loop's syncs on the Manager: blocking, or overlapped with inner steps (Streaming DiLoCo).

Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512) hides a sync's communication behind
computation: a fragment's pseudo-gradients are handed to the all-reduce ``tau``
(``fragment_sync_delay``) inner steps before the outer step that needs their mean, and the inner
steps run meanwhile (gloo and NCCL all-reduce in the background). The schedule is torchft's
``DiLoCo``: the all-reduce starts before inner step ``k * H/F - tau`` and is waited for, committed
and applied before inner step ``k * H/F``, where a blocking sync (``tau = 0``) would do all of it.

Faults keep the blocking sync's rule: nothing of a sync that did not commit is applied. An
all-reduce that failed in flight (a peer died inside it) leaves ``should_commit()`` false; the
fragment is then synced again at once, blocking, on a new quorum, from the replica's current
parameters (as a tau = 0 sync at this step), which is also what a replica healed by that quorum
takes part in. A quorum is only ever started with no all-reduce in flight, so the state a peer
heals from never holds one; a checkpoint does (the values sent), and a run resumed from it hands
them to the all-reduce again at its first quorum.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_strategies.comm.ft.outer import OuterLoop
from lightning_strategies.comm.ft.step import CommitFailedError, CommitStats, average_and_commit, flatten

__all__ = ["OuterSync", "PendingSync", "SyncRecord"]


@dataclass
class PendingSync:
    """A fragment's all-reduce started and not yet applied.

    Attributes:
        fragment: the fragment being synced.
        started: the inner step before which it started (its values: after ``started`` steps).
        sent: what this replica handed to the all-reduce (kept for a checkpoint's resume).
        flat: the buffer being reduced in place (``None`` until issued).
        work: the Manager's all-reduce work (``None`` until issued).
        issued_t: wall time of the issue.
    """

    fragment: int
    started: int
    sent: torch.Tensor
    flat: torch.Tensor | None = None
    work: Any = None
    issued_t: float = 0.0


@dataclass(frozen=True)
class SyncRecord:
    """One committed sync, for metrics and tests: when its all-reduce was issued and waited for.

    Attributes:
        fragment: the fragment synced.
        started: the inner step before which its all-reduce was issued.
        finished: the inner step before which its outer step was applied.
        issued_t, waited_t: wall times of the issue and of the end of the wait.
        attempts: all-reduces it took (1: the overlapped one committed).
        participants: replicas in the quorum that committed it.
    """

    fragment: int
    started: int
    finished: int
    issued_t: float
    waited_t: float
    attempts: int
    participants: int


class OuterSync:
    """Runs :class:`~lightning_strategies.comm.ft.outer.OuterLoop`'s syncs, step by step.

    Call :meth:`advance` before every inner step (and once at the end of training): it starts the
    fragment whose all-reduce is due, and waits for, commits and applies the one whose outer step
    is due.

    Args:
        outer: the outer loop (its ``delay`` is tau, its ``alpha`` the merge weight).
        attempts: all-reduces per sync before :class:`CommitFailedError` (the overlapped one counts).
        requorum: starts a new quorum (blocking); returns whether it healed this replica.

    Attributes:
        history: the committed syncs of this run (:class:`SyncRecord`).
        on_issue: called with ``(when, fragment, step)`` around the issue of an all-reduce:
            ``"quorum"`` once its quorum is formed (the peers' all-reduces of it may be in flight)
            and before this replica hands its values over, ``"issued"`` right after, before anything
            waits for it. A seam for tests (the integration tests kill a replica at either point,
            inside the sync's all-reduce) and diagnostics; ``None`` in training.
    """

    def __init__(self, outer: OuterLoop, *, attempts: int, requorum: Callable[[], bool]) -> None:
        if attempts < 1:
            raise ValueError(f"attempts={attempts}: expected >= 1. Fix: pass attempts=3.")
        self.outer, self.attempts, self.requorum = outer, attempts, requorum
        self.pending: PendingSync | None = None
        self.history: list[SyncRecord] = []
        self.on_issue: Callable[[str, int, int], None] | None = None
        self._last_step = -1

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return self.outer.pseudo_grad_dtype if self.outer.algorithm == "diloco" else None

    def advance(self, manager: Any, step: int, *, quorum_open: bool = False, end: bool = False) -> CommitStats | None:
        """The syncs due before inner step ``step`` (``end``: after the last one).

        Args:
            manager: the replica's ``torchft.manager.Manager``.
            step: inner steps taken so far (Lightning's ``global_step``).
            quorum_open: a quorum was started for this step and is not used yet (a joining
                replica's): the first all-reduce runs on it rather than on a new one.
            end: training ends here: an all-reduce in flight is waited for and applied now, and
                none is started unless it would be applied at once (``tau = 0``).

        Returns:
            The stats of a sync committed in this call, else ``None``.

        Raises:
            CommitFailedError: a sync did not commit in any of its attempts.
        """
        outer, fresh = self.outer, step != self._last_step
        self._last_step = step
        fragment = outer.starts(step)
        if (fresh and self.pending is None and fragment is not None and not (end and outer.delay)) or (
            self.pending is not None and self.pending.work is None  # a checkpoint's, issued again
        ):
            if not quorum_open:
                self.requorum()  # before the values are taken: a replica that heals here raises, mid-run
            quorum_open = False
            if self.pending is None:
                assert fragment is not None
                self.pending = PendingSync(fragment, step, flatten(outer.tensors(fragment), self.wire_dtype))
            self._issue(manager, step)
        if self.pending is not None and (end or step >= self.pending.started + outer.delay):
            return self._finish(manager, step)
        due = outer.due(step)
        if fresh and due is not None and self.pending is None:
            # due with nothing in flight: a healed replica joining its peers' blocking retry
            if not quorum_open:
                self.requorum()
            return self._blocking(manager, due, step, self.attempts)
        return None

    def _issue(self, manager: Any, step: int) -> None:
        pending = self.pending
        assert pending is not None
        pending.flat = pending.sent.clone()  # reduced in place; ``sent`` stays for a checkpoint
        if self.on_issue is not None:
            self.on_issue("quorum", pending.fragment, step)
        pending.issued_t = time.time()
        pending.work = manager.allreduce(pending.flat)  # errors are swallowed and reported to should_commit
        if self.on_issue is not None:
            self.on_issue("issued", pending.fragment, step)

    def _finish(self, manager: Any, step: int) -> CommitStats:
        pending = self.pending
        assert pending is not None and pending.flat is not None
        self.pending = None  # no quorum below ever sees it in flight (the state a peer heals from)
        wait_t = time.time()
        pending.work.wait()
        waited_t = time.time()
        size = pending.flat.numel() * pending.flat.element_size()
        if manager.should_commit():
            self.outer.apply(pending.fragment, pending.flat, mix=True)
            # seconds: what the replica waited for (the overlapped inner steps are not communication time)
            stats = CommitStats(attempts=1, participants=int(manager.num_participants()), bytes=size,
                                seconds=time.time() - wait_t)  # fmt: skip
            self._log(pending.fragment, pending.started, step, pending.issued_t, waited_t, stats)
            return stats
        # the all-reduce failed in flight: its mean is dropped whole; the fragment is synced again now,
        # blocking, on a new quorum, from the current parameters
        if self.attempts < 2:
            raise CommitFailedError(
                f"found the all-reduce of fragment {pending.fragment} failed (error: {manager.errored()}) with "
                "attempts=1: expected a committed sync. Fix: raise commit_attempts, or check that enough replicas run."
            )
        failed = CommitStats(attempts=1, bytes=size, seconds=waited_t - wait_t)
        failed.healed = self.requorum()
        return self._blocking(manager, pending.fragment, step, self.attempts - 1, failed)

    def _blocking(
        self, manager: Any, fragment: int, step: int, attempts: int, failed: CommitStats | None = None
    ) -> CommitStats:
        """A sync of ``fragment`` on the open quorum, waited for at once (tried again on new quorums);
        ``failed``: the overlapped attempt before it, counted in the returned stats."""
        outer, issued_t = self.outer, time.time()
        flat, stats = average_and_commit(
            manager, lambda: outer.tensors(fragment), attempts=attempts, requorum=self.requorum,
            wire_dtype=self.wire_dtype,
        )  # fmt: skip
        outer.apply(fragment, flat)
        if failed is not None:
            stats.attempts += failed.attempts
            stats.bytes += failed.bytes
            stats.seconds += failed.seconds
            stats.healed |= failed.healed
        self._log(fragment, step, step, issued_t, time.time(), stats)
        return stats

    def _log(self, fragment: int, started: int, finished: int, issued: float, waited: float, s: CommitStats) -> None:
        self.history.append(SyncRecord(fragment, started, finished, issued, waited, s.attempts, s.participants))

    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state and the values of an all-reduce in flight (``pending``)."""
        p = self.pending
        pending = None if p is None else {"fragment": p.fragment, "started": p.started, "sent": p.sent.clone()}
        return {**self.outer.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned; an all-reduce it held is issued again at the next
        :meth:`advance` (every replica resumed from the same checkpoint does the same)."""
        self.outer.load_state_dict(state)
        p = state.get("pending")
        self.pending = None if p is None else PendingSync(int(p["fragment"]), int(p["started"]), p["sent"].clone())
        self._last_step = -1
