"""A pipeline step's recorded timeline cut into the schedule's bubble, stalls and transfer overhead.

The runtime records its chunks (:data:`~lightning_strategies.comm.pipeline.Event`) when asked;
only the benchmarks analyse them: :func:`replay`, :func:`typical_durations`, :func:`analyse`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from lightning_strategies.comm.pipeline import Event

__all__ = ["analyse", "replay", "typical_durations"]


def replay(events: Sequence[Sequence[Event]], duration: Callable[[Event], float] | None = None) -> float:
    """The span of the recorded chunks with zero time between them (transfers and Python removed).

    Each rank runs its chunks in the recorded order; a chunk starts when its rank is free and its
    input is ready: stage ``s``'s forward of micro-batch ``i`` needs stage ``s-1``'s, its
    backward needs stage ``s+1``'s (the last stage's, its own forward, which precedes it).

    Args:
        events: per rank, its chunks by start time.
        duration: a chunk's duration; default the measured ``end - start``.

    Returns:
        The ideal span in seconds.
    """
    last_stage = max(e[0] for rank in events for e in rank)
    ends: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(events)
    pos = [0] * len(events)
    while any(p < len(rank) for p, rank in zip(pos, events, strict=True)):
        progressed = False
        for r, rank in enumerate(events):
            while pos[r] < len(rank):
                stage, kind, mb, t0, t1 = rank[pos[r]]
                if kind == "F":
                    dep = ("F", stage - 1, mb) if stage > 0 else None
                elif kind == "B":
                    dep = ("B", stage + 1, mb) if stage < last_stage else None
                else:  # the loss follows its forward on the same rank
                    dep = None
                if dep is not None and dep not in ends:
                    break
                start = max(free[r], ends[dep] if dep is not None else 0.0)
                free[r] = ends[(kind, stage, mb)] = start + (duration(rank[pos[r]]) if duration else t1 - t0)
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded chunks wait on each other: not a timeline of one step")
    return max(free)


def typical_durations(steps: Sequence[Sequence[Sequence[Event]]]) -> dict[tuple[int, str], float]:
    """Each stage's median forward and backward chunk over the given steps' timelines."""
    durations: dict[tuple[int, str], list[float]] = {}
    for events in steps:
        for rank in events:
            for e in rank:
                durations.setdefault((e[0], e[1]), []).append(e[4] - e[3])
    return {key: statistics.median(values) for key, values in durations.items()}


def analyse(
    starts: Sequence[float],
    ends: Sequence[float],
    events: Sequence[Sequence[Event]],
    typical: dict[tuple[int, str], float],
) -> dict[str, float]:
    """One step's timeline cut into the schedule's bubble, stalls (``jitter``) and ``overhead``.

    ``bubble``: the replay with every chunk lasting its stage's typical (median) forward or
    backward, ``1 - compute / span`` of that timeline (the schedule's fill and drain, for the
    stages' typical costs). ``jitter``: what the measured durations add to the replayed span
    (chunks the host stalled), ``overhead``: what the real span adds to that (transfers, Python
    between chunks), both as shares of the real span. ``idle``: ``1 - compute / real span``.
    """

    def typical_duration(e: Event) -> float:
        return typical[(e[0], e[1])]

    span = max(ends) - min(starts)
    ideal = replay(events)
    smooth = replay(events, typical_duration)
    busy = [sum(e[4] - e[3] for e in rank) for rank in events]
    return {
        "span": span,
        "idle": statistics.fmean(1.0 - b / span for b in busy),
        "bubble": statistics.fmean(1.0 - sum(map(typical_duration, rank)) / smooth for rank in events),
        "jitter": (ideal - smooth) / span,
        "overhead": (span - ideal) / span,
        "max_busy": max(busy),
    }
