"""benchmarks/_pipeline_timeline: replay of recorded chunks, the bubble, jitter and overhead."""

from __future__ import annotations

import pytest

from benchmarks._pipeline_timeline import analyse, replay, typical_durations
from lightning_strategies.comm.pipeline import Event

# GPipe, 2 stages, 2 micro-batches, forward 1 s and backward 2 s, back to back: the ideal timeline
STAGE0: list[Event] = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 5, 7), (0, "B", 1, 7, 9)]
STAGE1: list[Event] = [(1, "F", 0, 1, 2), (1, "F", 1, 2, 3), (1, "B", 0, 3, 5), (1, "B", 1, 5, 7)]


def test_replay_of_an_ideal_gpipe_step_is_its_span() -> None:
    assert replay([STAGE0, STAGE1]) == 9  # (M + K - 1) x (forward + backward)
    assert replay([STAGE0, STAGE1], lambda e: 1.0) == 6  # every chunk 1 s: 3 slots of 2 chunks


def test_replay_refuses_chunks_waiting_on_each_other() -> None:
    with pytest.raises(RuntimeError, match="wait on each other"):
        replay([[(0, "B", 0, 0, 1)], [(1, "F", 0, 0, 1), (1, "B", 1, 1, 2)]])


def test_analyse_an_ideal_step_is_all_schedule_bubble() -> None:
    events = [STAGE0, STAGE1]
    typical = typical_durations([events])
    assert typical == {(0, "F"): 1, (0, "B"): 2, (1, "F"): 1, (1, "B"): 2}
    result = analyse([0, 1], [9, 7], events, typical)
    assert result["span"] == 9 and result["max_busy"] == 6
    assert result["bubble"] == pytest.approx(1 / 3)  # (K - 1) / (M + K - 1)
    assert result["idle"] == pytest.approx(1 / 3)
    assert result["jitter"] == pytest.approx(0) and result["overhead"] == pytest.approx(0)


def test_analyse_separates_overhead_between_chunks() -> None:
    late = [[(s, k, m, t0 + 1, t1 + 1) for s, k, m, t0, t1 in STAGE0], STAGE1]  # stage 0 starts 1 s late
    result = analyse([1, 1], [10, 7], late, typical_durations([late]))
    assert result["overhead"] == pytest.approx(0)  # the span starts at the first chunk
    stretched = analyse([0, 1], [12, 7], [STAGE0, STAGE1], typical_durations([[STAGE0, STAGE1]]))
    assert stretched["overhead"] == pytest.approx(3 / 12)
