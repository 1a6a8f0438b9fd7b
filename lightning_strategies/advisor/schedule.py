"""A GPipe step simulated: stages sharing cores, each chunk waiting for its input to arrive.

Pure arithmetic; :func:`~lightning_strategies.advisor.model.predict` prices the pipeline with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["pipeline_busy", "pipeline_makespan"]


def pipeline_busy(stages: int, microbatches: int) -> list[int]:
    """Stages busy in each of the M + K - 1 slots of a pipelined pass (fill, steady state, drain)."""
    k, m = stages, microbatches
    return [min(j + 1, k, m, m + k - 1 - j) for j in range(m + k - 1)]


def pipeline_makespan(
    stages: int,
    microbatches: int,
    forward_s: float,
    backward_s: float,
    *,
    hop: Callable[[int], float] = lambda busy: 0.0,
    cores: float | None = None,
    replicas: int = 1,
) -> float:
    """Seconds of one GPipe step of ``replicas`` pipelines of ``stages`` processes sharing ``cores``.

    Each stage runs its M forward chunks, then its M backward chunks (micro-batch order, as
    ``torch.distributed.pipelining``'s ScheduleGPipe); stage s's forward of micro-batch m needs
    stage s-1's, its backward stage s+1's (the last stage's, its own forward, done by then). A
    chunk is ``forward_s`` or ``backward_s`` of work for one core; while n processes are busy each
    progresses at min(1, cores / n) (``cores=None``: 1, a device each). A chunk's output reaches
    the next stage ``hop(b)`` after it ends, b the processes busy at that moment besides the
    receiver (the sender included when it goes straight on to its next chunk).
    """
    k, m = stages, microbatches
    order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    # with a device each the replicas do not interact: one is enough
    procs = [(r, s) for r in range(replicas if cores is not None else 1) for s in range(k)]
    pos = dict.fromkeys(procs, 0)
    left: dict[tuple[int, int], float] = {}  # busy processes: work left in their chunk
    ready: dict[tuple[int, str, int, int], float] = {}  # (replica, kind, stage, micro-batch): input arrives
    idle = set(procs)

    def needs(p: tuple[int, int]) -> tuple[int, str, int, int] | None:
        (r, s), (kind, i) = p, order[pos[p]]
        if kind == "F":
            return (r, "F", s - 1, i) if s > 0 else None
        return (r, "B", s + 1, i) if s < k - 1 else None

    t = 0.0
    while True:
        for p in sorted(idle):
            if pos[p] < len(order) and ((dep := needs(p)) is None or ready.get(dep, math.inf) <= t):
                left[p] = forward_s if order[pos[p]][0] == "F" else backward_s
                idle.discard(p)
        if not left:
            arrivals = [ready.get(d, math.inf) for p in idle if pos[p] < len(order) and (d := needs(p)) is not None]
            if not arrivals:
                return t
            t = min(arrivals)  # nothing runs until the next input arrives
            continue
        rate = 1.0 if cores is None else min(1.0, cores / len(left))
        done_in = min(left.values()) / rate
        waiting = [ready[d] - t for p in idle if pos[p] < len(order) and (d := needs(p)) in ready and ready[d] > t]
        dt = min([done_in, *waiting])
        t += dt
        finished = [p for p, w in left.items() if w - dt * rate <= 1e-12 * max(forward_s, backward_s, 1e-30)]
        for p in left:
            left[p] -= dt * rate
        sent = []
        for p in finished:
            del left[p]
            kind, i = order[pos[p]]
            pos[p] += 1
            idle.add(p)
            r, s = p
            if (kind == "F" and s < k - 1) or (kind == "B" and s > 0):
                sent.append(((r, kind, s, i), (r, s + 1 if kind == "F" else s - 1)))
        # the senders that go straight on count as busy for the messages they just sent
        starting = [p for p in idle if pos[p] < len(order) and ((d := needs(p)) is None or ready.get(d, math.inf) <= t)]
        for key, receiver in sent:
            busy = sum(1 for p in (*left, *starting) if p != receiver)
            ready[key] = t + hop(busy)
