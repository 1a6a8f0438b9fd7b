"""The pipeline's simulated step (lightning_strategies/advisor/schedule.py) against timelines worked out by hand:
the schedules' chunk orders (torch.distributed.pipelining's GPipe and 1F1B), the links between nodes
(one message at a time per direction), stages of different lengths. Tolerance: float sums, rel=1e-12.
"""

from __future__ import annotations

import math

import pytest

from lightning_strategies.advisor import load_cluster
from lightning_strategies.advisor.costs import Costs, Link, Workload
from lightning_strategies.advisor.model import predict
from lightning_strategies.advisor.schedule import pipeline_makespan, pipeline_order

REL = 1e-12
FAST = Link(0.0, math.inf)


def F(*ids: int) -> list[tuple[str, int]]:
    return [("F", i) for i in ids]


def B(*ids: int) -> list[tuple[str, int]]:
    return [("B", i) for i in ids]


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    assert pipeline_order("gpipe", 2, 3, 0) == F(0, 1, 2) + B(0, 1, 2)


def test_1f1b_is_torch_schedule1f1b_k_minus_s_forwards_then_backward_and_forward_in_turn() -> None:
    # Schedule1F1B: warm-up min(M, K - s) forwards, then 1B1F until the forwards run out, then the backwards
    assert pipeline_order("1f1b", 4, 6, 0) == [*F(0, 1, 2, 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5), *B(2, 3, 4, 5)]
    turns = [("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("F", 4), ("B", 3), ("F", 5)]
    assert pipeline_order("1f1b", 4, 6, 2) == [*F(0, 1), *turns, *B(4, 5)]
    last = pipeline_order("1f1b", 4, 6, 3)
    assert last == [x for i in range(6) for x in (("F", i), ("B", i))]
    assert pipeline_order("1f1b", 4, 2, 0) == F(0, 1) + B(0, 1)  # fewer micro-batches than stages
    with pytest.raises(ValueError, match="expected one of"):
        pipeline_order("zb", 2, 2, 0)


def test_1f1b_waits_for_each_backward_where_gpipe_runs_ahead() -> None:
    # K=2, M=3, chunks of 1, a device each, every hop 0.5.
    # 1F1B: s0 F0 [0,1] F1 [1,2]; s1 F0 [1.5,2.5] B0 [2.5,3.5] F1 [3.5,4.5] B1 [4.5,5.5]; s0 B0 [4,5]
    # F2 [5,6] B1 [6,7]; s1 F2 [6.5,7.5] B2 [7.5,8.5]; s0 B2 [9,10]
    hop = 0.5
    assert pipeline_makespan(2, 3, 1.0, 1.0, hop=lambda b: hop, schedule="1f1b") == pytest.approx(10.0, rel=REL)
    # GPipe: s0 F0..F2 [0,3]; s1 F0 [1.5,2.5] F1 F2 [.., 4.5] B0 [4.5,5.5] B1 B2 [.., 7.5]; s0 B0 [6,7] .. B2 [8,9]
    assert pipeline_makespan(2, 3, 1.0, 1.0, hop=lambda b: hop, schedule="gpipe") == pytest.approx(9.0, rel=REL)


def test_a_link_between_nodes_carries_one_message_at_a_time_each_way() -> None:
    # K=2, M=2 GPipe on two nodes, chunks of 1, a message 2 on the wire then 0.5 of latency:
    # s0 F0 [0,1], wire [1,3], arrives 3.5; F1 [1,2], wire once free [3,5], arrives 5.5; s1 F0 [3.5,4.5]
    # F1 [5.5,6.5] B0 [6.5,7.5] (wire back [7.5,9.5], at s0 10) B1 [7.5,8.5] (wire [9.5,11.5], 12);
    # s0 B0 [10,11] B1 [12,13]
    wire = {"cross_latency_s": 0.5, "cross_transfer_s": 2.0}
    assert pipeline_makespan(2, 2, 1.0, 1.0, node_of=lambda p: p, **wire) == pytest.approx(13.0, rel=REL)
    assert pipeline_makespan(2, 2, 1.0, 1.0, node_of=lambda p: 0, **wire) == pytest.approx(6.0, rel=REL)  # one node


def test_stages_of_different_lengths() -> None:
    # K=2, M=1: s0 F [0,1]; s1 F [1,3] B [3,5]; s0 B [5,6]
    assert pipeline_makespan(2, 1, [1.0, 2.0], [1.0, 2.0]) == pytest.approx(6.0, rel=REL)
    with pytest.raises(ValueError, match="one per stage"):
        pipeline_makespan(2, 1, [1.0], 1.0)


def test_predicted_pipeline_crosses_nodes_only_between_stages_on_different_nodes() -> None:
    costs = Costs(compute_s=0.0, local_size=2, intra=FAST, inter=Link(0.5, 1e6))
    work = Workload(grad_bytes=0.0, stages=4, microbatches=1, activation_bytes=1e6, stage_compute_s=2.0,
                    backward_share=0.5)  # fmt: skip
    # 2 nodes of 2 stages, M=1, chunks of 1: s0 F [0,1] s1 [1,2], across (1 s wire + 0.5) s2 [3.5,4.5]
    # s3 F [4.5,5.5] B [5.5,6.5], s2 B [6.5,7.5], across: s1 B [9,10], s0 B [10,11]
    assert predict("pipeline", costs, 4, work).step_s == pytest.approx(11.0, rel=REL)
    # one node: no wire, 8 chunks
    assert predict("pipeline", costs.with_(local_size=4), 4, work).step_s == pytest.approx(8.0, rel=REL)
    # each stage its own time: K=2, M=1 with stages of 2 and 4 (halves forward, backward): 1 + 2 + 2 + 1
    uneven = Workload(grad_bytes=0.0, stages=2, microbatches=1, stage_seconds=(2.0, 4.0), backward_share=0.5)
    assert predict("pipeline", costs.with_(local_size=4), 2, uneven).step_s == pytest.approx(6.0, rel=REL)


def test_the_emulated_presets_carry_the_measured_wake_ups() -> None:
    costs = load_cluster("emulated_2x2_1gbit").costs(0.01)
    assert costs.hop_s == pytest.approx((85.06e-6, 374.8e-6, 475.8e-6, 605.7e-6), rel=REL)  # scale.txt, P = 4
    assert load_cluster("a100").costs(0.01).hop_s == ()  # none measured: the link's latency and bytes
