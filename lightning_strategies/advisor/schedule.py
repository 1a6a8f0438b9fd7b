"""A pipeline step simulated: stages sharing cores, each chunk waiting for its input to arrive.

Pure arithmetic; :func:`~lightning_strategies.advisor.model.predict` prices the pipeline with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["SCHEDULES", "pipeline_busy", "pipeline_makespan", "pipeline_order"]

#: the schedules :func:`pipeline_order` writes out (``PipelineStrategy(schedule=...)``'s names)
SCHEDULES = ("gpipe", "1f1b")


def pipeline_busy(stages: int, microbatches: int) -> list[int]:
    """Stages busy in each of the M + K - 1 slots of a pipelined pass (fill, steady state, drain)."""
    k, m = stages, microbatches
    return [min(j + 1, k, m, m + k - 1 - j) for j in range(m + k - 1)]


def pipeline_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The chunks stage ``stage`` runs, in order: ``("F", i)`` forward and ``("B", i)`` backward of micro-batch i.

    ``gpipe``: every forward, then every backward. ``1f1b`` (``torch.distributed.pipelining``'s
    Schedule1F1B): min(M, K - s) forwards, then a backward and a forward in turn until the forwards
    run out, then the remaining backwards.

    Raises:
        ValueError: for a schedule not in :data:`SCHEDULES`.
    """
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"pipeline schedule {schedule!r}: expected one of {list(SCHEDULES)}. Fix: use one of them")
    warmup = min(m, stages - stage)
    order, f, b = [("F", i) for i in range(warmup)], warmup, 0
    while b < m:
        order.append(("B", b))
        b += 1
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def _per_stage(value: float | Sequence[float], stages: int) -> list[float]:
    values = [float(value)] * stages if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != stages:
        raise ValueError(f"found {len(values)} per-stage times: expected one per stage ({stages})")
    return values


def pipeline_makespan(
    stages: int,
    microbatches: int,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    *,
    hop: Callable[[int], float] = lambda busy: 0.0,
    cores: float | None = None,
    replicas: int = 1,
    schedule: str = "gpipe",
    node_of: Callable[[int], int] | None = None,
    cross_latency_s: float = 0.0,
    cross_transfer_s: float = 0.0,
) -> float:
    """Seconds of one pipeline step of ``replicas`` pipelines of ``stages`` processes sharing ``cores``.

    Each stage runs its chunks in :func:`pipeline_order`'s order for ``schedule``; stage s's forward of
    micro-batch m needs stage s-1's, its backward stage s+1's (the last stage's, its own forward, done
    by then). A chunk is ``forward_s`` or ``backward_s`` of work for one core (one value, or one per
    stage); while n processes are busy each progresses at min(1, cores / n) (``cores=None``: 1, a
    device each). A chunk's output reaches the next stage ``hop(b)`` after it is sent, b the processes
    busy at that moment besides the receiver (the sender included when it goes straight on to its
    next chunk): the receiver's wake-up. Processes are numbered replica x K + stage (the strategy's
    (dp, pp) mesh); a message between processes on different nodes (``node_of(process)``) first
    crosses both nodes' links, each one message at a time in each direction (first come, first
    served): ``cross_transfer_s`` on the sender's outgoing and the receiver's incoming link at once,
    then ``cross_latency_s``.
    """
    k, m = stages, microbatches
    fwd, bwd = _per_stage(forward_s, k), _per_stage(backward_s, k)
    orders = [pipeline_order(schedule, k, m, s) for s in range(k)]
    # with a device each and one node the replicas do not interact: one is enough
    alone = cores is None and (node_of is None or replicas == 1)
    procs = [(r, s) for r in range(1 if alone else replicas) for s in range(k)]
    pos = dict.fromkeys(procs, 0)
    left: dict[tuple[int, int], float] = {}  # busy processes: work left in their chunk
    ready: dict[tuple[int, str, int, int], float] = {}  # (replica, kind, stage, micro-batch): input arrives
    idle = set(procs)
    link_free: dict[tuple[int, str], float] = {}  # (node, "out" / "in"): when its link is next free

    def needs(p: tuple[int, int]) -> tuple[int, str, int, int] | None:
        (r, s), (kind, i) = p, orders[p[1]][pos[p]]
        if kind == "F":
            return (r, "F", s - 1, i) if s > 0 else None
        return (r, "B", s + 1, i) if s < k - 1 else None

    def pending(p: tuple[int, int]) -> bool:
        return pos[p] < len(orders[p[1]])

    def arrival(sender: tuple[int, int], receiver: tuple[int, int], t: float) -> float:
        """When a message sent at ``t`` is in the receiver's socket (before its wake-up)."""
        if node_of is None:
            return t
        a, b = node_of(sender[0] * k + sender[1]), node_of(receiver[0] * k + receiver[1])
        if a == b:
            return t
        start = max(t, link_free.get((a, "out"), 0.0), link_free.get((b, "in"), 0.0))
        link_free[a, "out"] = link_free[b, "in"] = start + cross_transfer_s
        return start + cross_transfer_s + cross_latency_s

    t = 0.0
    while True:
        for p in sorted(idle):
            if pending(p) and ((dep := needs(p)) is None or ready.get(dep, math.inf) <= t):
                left[p] = fwd[p[1]] if orders[p[1]][pos[p]][0] == "F" else bwd[p[1]]
                idle.discard(p)
        if not left:
            arrivals = [ready.get(d, math.inf) for p in idle if pending(p) and (d := needs(p)) is not None]
            if not arrivals:
                return t
            t = min(arrivals)  # nothing runs until the next input arrives
            continue
        rate = 1.0 if cores is None else min(1.0, cores / len(left))
        done_in = min(left.values()) / rate
        waiting = [ready[d] - t for p in idle if pending(p) and (d := needs(p)) in ready and ready[d] > t]
        dt = min([done_in, *waiting])
        t += dt
        finished = [p for p, w in left.items() if w - dt * rate <= 1e-12 * max(*fwd, *bwd, 1e-30)]
        for p in left:
            left[p] -= dt * rate
        sent = []
        for p in finished:
            del left[p]
            kind, i = orders[p[1]][pos[p]]
            pos[p] += 1
            idle.add(p)
            r, s = p
            if (kind == "F" and s < k - 1) or (kind == "B" and s > 0):
                sent.append(((r, kind, s, i), p, (r, s + 1 if kind == "F" else s - 1)))
        # the senders that go straight on count as busy for the messages they just sent
        starting = [p for p in idle if pending(p) and ((d := needs(p)) is None or ready.get(d, math.inf) <= t)]
        for key, sender, receiver in sent:
            busy = sum(1 for p in (*left, *starting) if p != receiver)
            ready[key] = arrival(sender, receiver, t) + hop(busy)
