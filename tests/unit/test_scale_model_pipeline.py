"""The scale model's pipeline (lightning_strategies/advisor/model.py) against values worked out by hand.

The slots that fill and drain, the makespan on shared cores, the hops between stages (by the processes
busy when one is sent, and across nodes), and the chunk overhead inverted from the tiny pipeline. Each
test isolates one term in its costs (``_scale_model_cases.costs``); rel=1e-12, or 1e-9 where a test says so.
"""

from __future__ import annotations

import math

import pytest
from _scale_model_cases import FAST, REL, D, costs

from benchmarks._scale_costs import slower, solve_chunk_overhead
from lightning_strategies.advisor.model import Link, Workload, pipeline_busy, pipeline_makespan, predict


def test_pipeline_slots_fill_and_drain() -> None:
    assert pipeline_busy(2, 4) == [1, 2, 2, 2, 1]
    assert pipeline_busy(4, 2) == [1, 2, 2, 2, 1]
    assert sum(pipeline_busy(4, 8)) == 4 * 8  # every stage runs every micro-batch once


def test_pipeline_step_is_m_plus_k_minus_1_chunks_and_2_k_minus_1_transfers() -> None:
    chunk, alpha = 0.01, 1e-3
    work = Workload(grad_bytes=D, stages=4, microbatches=8, activation_bytes=0.0, stage_compute_s=chunk)
    got = predict("pipeline", costs(intra=Link(alpha, math.inf)), 4, work)
    assert got.step_s == pytest.approx((8 + 4 - 1) * chunk + 2 * 3 * alpha, rel=REL)


def test_pipeline_on_shared_cores_is_its_work_over_the_cores_when_they_are_the_bottleneck() -> None:
    chunk = 0.01
    work = Workload(grad_bytes=D, stages=2, microbatches=2, stage_compute_s=chunk, backward_share=0.5)
    # one core for 2 stages: F(0,1) and F(1,0) share it from t = 1/2 chunk, and so do B(1,1) and
    # B(0,0): the core never idles once both have work, so the span is all the work, 4 chunks
    assert predict("pipeline", costs(cores=1.0), 2, work).step_s == pytest.approx(4 * chunk, rel=REL)
    # two cores: no sharing, (M+K-1) chunks
    assert predict("pipeline", costs(cores=2.0), 2, work).step_s == pytest.approx(3 * chunk, rel=REL)


def test_pipeline_makespan_by_hand() -> None:
    # K=2, M=2, chunks of 1 on one core: F(0,0) [0,1]; F(0,1) and F(1,0) at rate 1/2 [1,3]; F(1,1)
    # [3,4]; B(1,0) [4,5]; B(1,1) and B(0,0) at rate 1/2 [5,7]; B(0,1) [7,8]
    assert pipeline_makespan(2, 2, 1.0, 1.0, cores=1.0) == pytest.approx(8.0, rel=REL)
    assert pipeline_makespan(2, 2, 1.0, 1.0, cores=2.0) == pytest.approx(6.0, rel=REL)
    assert pipeline_makespan(4, 8, 1.0, 2.0) == pytest.approx((8 + 4 - 1) * 3.0, rel=REL)
    assert pipeline_makespan(4, 8, 1.0, 2.0, hop=lambda busy: 0.1) == pytest.approx(33 + 2 * 3 * 0.1, rel=REL)
    # replicas on a device each do not interact; on shared cores they do (twice the work on 2 cores)
    assert pipeline_makespan(2, 2, 1.0, 1.0, replicas=2) == pytest.approx(6.0, rel=REL)
    assert pipeline_makespan(2, 2, 1.0, 1.0, cores=2.0, replicas=2) == pytest.approx(8.0, rel=REL)


def test_a_hop_waits_by_the_processes_busy_when_it_is_sent() -> None:
    def hop(busy: int) -> float:
        return 0.1 * (busy + 1)

    # K=2, M=1: F(0,0) [0,1], stage 0 then waits (busy 0: +0.1); F(1,0) [1.1,2.1], B(1,0) [2.1,3.1];
    # its gradient to the idle stage 0 (busy 0: +0.1); B(0,0) [3.2,4.2]
    assert pipeline_makespan(2, 1, 1.0, 1.0, hop=hop) == pytest.approx(4.2, rel=REL)
    # K=2, M=2, a device each: F(0,0) ends at 1 and stage 0 goes on to F(0,1) (busy 1: +0.2);
    # F(1,0) [1.2,2.2]; F(0,1) ends at 2 while stage 1, the receiver, computes (busy 0: +0.1);
    # F(1,1) [2.2,3.2], B(1,0) [3.2,4.2], sent while stage 1 goes on to B(1,1) (busy 1: +0.2);
    # B(0,0) [4.4,5.4]; B(1,1) ends at 5.2 (receiver busy: +0.1); B(0,1) [5.4,6.4]
    assert pipeline_makespan(2, 2, 1.0, 1.0, hop=hop) == pytest.approx(6.4, rel=REL)
    c = costs(hop_s=(0.1, 0.2))
    assert c.hop(0, FAST) == 0.1
    assert c.hop(5, FAST) == 0.2  # the last entry for more busy processes
    assert c.hop(0, Link(0.0, 1e6), nbytes=1e5) == 0.1  # measured at the run's size: its bytes are in it
    assert costs().hop(0, Link(1e-3, 1e6), nbytes=1e5) == pytest.approx(1e-3 + 0.1, rel=REL)
    assert costs().hop(2, Link(3e-6, math.inf)) == 3e-6  # no table: the link's
    # a hop waits for a core behind the machine's other runnable work: slowed as the work is
    assert slower(c, 2.0).hop_s == pytest.approx((0.2, 0.4), rel=REL)


def test_a_pipeline_hop_across_nodes_adds_the_wire_beyond_the_in_node_hop() -> None:
    # K = 2 stages on 2 nodes, M = 1, forward 1 s and backward 2 s per stage, no compute contention.
    # The hop (the receiver's side: the in-node link's 0.1 s) already pays a message's host cost; across
    # nodes the wire adds the inter-node latency beyond it (0.25 - 0.1) and 0.5 s of transfer each way
    c = costs(local_size=1, intra=Link(0.1, math.inf), inter=Link(0.25, 1.0))
    work = Workload(grad_bytes=0.0, stages=2, microbatches=1, activation_bytes=0.5, stage_compute_s=3.0,
                    schedule="gpipe")  # fmt: skip
    hop = 0.1 + 0.15 + 0.5
    assert predict("pipeline", c, 2, work).step_s == pytest.approx(1 + hop + 1 + 2 + hop + 2, rel=1e-9)


def test_chunk_overhead_is_the_pipeline_model_inverted_on_the_tiny_pipeline() -> None:
    hops, cores = (1e-4, 4e-4), 1.5
    o = 3e-4
    tiny = pipeline_makespan(2, 4, o, o, hop=lambda b: hops[min(b, 1)], cores=cores)
    assert solve_chunk_overhead(tiny, 4, hops, cores) == pytest.approx(o, rel=1e-9)  # bisection to 2^-60
    assert solve_chunk_overhead(1e-5, 4, hops, cores) == 0.0  # the hops alone take longer: no work left
