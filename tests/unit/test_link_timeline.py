"""``benchmarks/_link_timeline.py``: a sampled link's states, segments and per-step figures on hand-built samples.

The quick cluster run in CI exercises the sampling on real links; here every figure is checked against
arithmetic done by hand on counters whose rates are chosen per interval.
"""

from __future__ import annotations

import pytest

from benchmarks._link_timeline import analyse, describe, rates, segments, state

RATE = 4 * 65536 / 0.05  # bytes per second of the shaped link: an interval spans at least 50 ms (4 GSO packets)


def counters(rows: list[tuple[float, float, float]]) -> list[list[float]]:
    """Cumulative ``[t, tx, rx]`` samples from per-interval ``(duration s, tx B/s, rx B/s)``, starting at t = 10."""
    t, tx, rx, out = 10.0, 0.0, 0.0, [[10.0, 0.0, 0.0]]
    for dt, a, b in rows:
        t, tx, rx = t + dt, tx + a * dt, rx + b * dt
        out.append([t, tx, rx])
    return out


def test_rates_are_the_counters_differences_over_time() -> None:
    got = rates(counters([(0.5, 800.0, 0.0), (0.25, 0.0, 400.0)]), RATE)
    assert [pytest.approx(g) for g in got] == [(10.0, 10.5, 800.0, 0.0), (10.5, 10.75, 0.0, 400.0)]
    assert rates([[1.0, 5, 5], [1.0, 9, 9]], RATE) == []  # no time between two samples: no interval


def test_rates_merge_samples_closer_than_four_packets_at_the_rate() -> None:
    # samples every 20 ms: intervals of 3 samples' time (60 ms, the first >= 50 ms), the rate over each
    got = rates(counters([(0.02, 100.0, 0.0)] * 3 + [(0.02, 400.0, 0.0)] * 3 + [(0.02, 0.0, 0.0)]), RATE)
    assert [pytest.approx(g) for g in got] == [(10.0, 10.06, 100.0, 0.0), (10.06, 10.12, 400.0, 0.0)]


@pytest.mark.parametrize(
    ("tx", "rx", "expected"),
    [(0.5, 0.5, "both"), (0.9, 0.01, "tx"), (0.0, 0.6, "rx"), (0.049, 0.0, "silent"), (0.1, 0.0, "low")],
)
def test_state_thresholds(tx: float, rx: float, expected: str) -> None:
    # busy: at least half the rate; silent: both directions under 5% of it
    assert state(tx * RATE, rx * RATE, RATE) == expected


def test_segments_merge_and_clip_to_the_step() -> None:
    iv = rates(
        counters([(0.1, 0.0, 0.0), (0.2, 0.9 * RATE, 0.0), (0.1, 0.95 * RATE, 0.0), (0.3, 0.9 * RATE, 0.9 * RATE)]),
        RATE,
    )
    # step from t = 10.05 to 10.5: silent 0-50 ms, tx 50-350, both 350-450 (clipped at the step's end)
    assert segments(iv, 10.05, 10.5, RATE) == [
        pytest.approx((0.0, 50.0, "silent")),
        pytest.approx((50.0, 350.0, "tx")),
        pytest.approx((350.0, 450.0, "both")),
    ]


def record(node: int, starts: list[float], rows: list[tuple[float, float, float]]) -> dict:
    return {"node": node, "warmup": 1, "phases": [{"t0": 9.0}] + [{"t0": t} for t in starts],
            "link_samples": counters(rows), "push_timeline": []}  # fmt: skip


def test_analyse_per_step_and_window_figures() -> None:
    # node 0: steps at 10.0, 10.4, 10.8 (two whole steps); each step 100 ms silent, then 300 ms at the full rate
    # one way; node 1: 200 ms both ways at the full rate, then 200 ms silent
    n0 = record(0, [10.0, 10.4, 10.8], [(0.1, 0.0, 0.0), (0.3, RATE, 0.0)] * 2)
    n1 = record(1, [10.0, 10.4, 10.8], [(0.2, RATE, RATE), (0.2, 0.0, 0.0)] * 2)
    other = {"node": 1, "link_samples": []}  # a rank that did not sample
    got = analyse({"records": [n0, n1, other]}, int(8 * RATE))
    assert got["step_ms"] == pytest.approx(400.0)
    assert got["silent_ms"] == pytest.approx((100.0 + 200.0) / 2)
    assert got["one_way_ms"] == pytest.approx((300.0 + 0.0) / 2)
    # bytes over 2 x rate x window: node 0 moves 0.6 s of one direction in 0.8 s (0.375), node 1 0.4 s of both
    assert got["util"] == pytest.approx((0.6 / 1.6 + 0.8 / 1.6) / 2)
    assert got["busy"] == pytest.approx((0.6 / 2 / 0.8 + 0.8 / 2 / 0.8) / 2)
    line = describe("ps_2x2_50mbit", got["nodes"][0])
    assert "silent 0-100, tx 100-400" in line and "400 ms step" in line


def test_ps_events_are_placed_in_the_step_whose_pushes_went_out() -> None:
    n0 = record(0, [10.0, 10.4, 10.8], [(0.4, RATE, RATE)] * 2)
    n0["push_timeline"] = [
        {"first_push": 10.01, "first_node_reduce": 10.005, "backward_end": 10.02, "pull_arrived": {"0": 10.3,
         "1": 10.35}, "pull_landed": {"0": 10.36}, "next_forward": 10.401},
        {"first_push": 10.41, "backward_end": 10.42, "pull_arrived": {}, "pull_landed": {}, "next_forward": None},
    ]  # fmt: skip
    got = analyse({"records": [n0]}, int(8 * RATE))
    # the events' medians over the two steps (the second has no replies: those of the first alone)
    assert got["events"]["first_push"] == pytest.approx(10.0)
    assert got["events"]["backward_end"] == pytest.approx(20.0)
    assert got["events"]["first_reply"] == pytest.approx(300.0)
    assert got["events"]["last_reply"] == pytest.approx(350.0)
    assert got["events"]["last_landed"] == pytest.approx(360.0)
    assert got["events"]["first_node_reduce"] == pytest.approx(5.0)


def test_too_few_timed_steps_say_what_to_pass() -> None:
    one = record(0, [10.0], [(0.4, RATE, RATE)])  # one timed step: it has no end
    with pytest.raises(ValueError, match=r"at least 2 timed steps.*--steps at least --warmup \+ 2"):
        analyse({"records": [one]}, int(8 * RATE))
