"""The scale model's rings (lightning_strategies/advisor/model.py) against values worked out by hand.

ddp and ring (flat, bf16 and hierarchical): the bytes a worker sends, the bandwidth and latency terms per
DDP bucket and segment, the backward's overlap, and tensor parallelism's all-reduces. Each test isolates
one term in its costs (``_scale_model_cases.costs``: every other constant 0 or infinitely fast); rel=1e-12.
"""

from __future__ import annotations

import math

import pytest
from _scale_model_cases import REL, D, costs, one_bucket

from benchmarks._scale_costs import Cluster, cluster_costs
from lightning_strategies.advisor.model import MIB, Link, Workload, ddp_buckets, predict


@pytest.mark.parametrize("world", [2, 3, 4, 8, 1024])
def test_ring_sends_2_p_minus_1_over_p_of_the_gradient(world: int) -> None:
    for name in ("ddp", "ring"):
        got = predict(name, costs(), world, one_bucket())
        assert got.busiest_sent_bytes == pytest.approx(2 * (world - 1) / world * D, rel=REL)
        assert got.link_bytes == pytest.approx(2 * (world - 1) / world * D, rel=REL)
        assert got.nic_bytes == 0.0  # one node


def test_ring_bandwidth_term_is_2_p_minus_1_over_p_d_over_beta() -> None:
    beta = 1e9
    got = predict("ring", costs(intra=Link(0.0, beta)), 4, one_bucket())
    assert got.step_s == pytest.approx(2 * 3 / 4 * D / beta, rel=REL)


def test_ring_latency_term_is_2_p_minus_1_messages_per_bucket_and_segment() -> None:
    alpha = 1e-3
    # segments larger than any chunk: one message per step, 2(P-1) steps
    c = costs(intra=Link(alpha, math.inf), ring_segment_bytes=math.inf, gloo_segment_bytes=math.inf)
    assert predict("ring", c, 4, one_bucket()).step_s == pytest.approx(6 * alpha, rel=REL)
    # 4 MiB segments: a 16 MiB chunk (D / 4) goes in 4 messages per step
    c4 = c.with_(ring_segment_bytes=4 * MIB)
    assert predict("ring", c4, 4, one_bucket()).step_s == pytest.approx(6 * 4 * alpha, rel=REL)
    # the ring's own per-message cost is added to the link's; gloo's (ddp) is not
    co = c.with_(ring_overhead_s=alpha)
    assert predict("ring", co, 4, one_bucket()).step_s == pytest.approx(6 * 2 * alpha, rel=REL)
    assert predict("ddp", co, 4, one_bucket()).step_s == pytest.approx(6 * alpha, rel=REL)


def test_overlap_hides_the_all_reduce_under_the_backward_pass_up_to_its_length() -> None:
    c = costs(compute_s=0.1, intra=Link(0.0, 1e9))
    comm = 2 * 3 / 4 * D / 1e9  # 0.1 s
    assert predict("ddp", c, 4, one_bucket()).step_s == pytest.approx(0.1 + comm, rel=REL)
    assert predict("ddp", c.with_(overlap_s=0.04), 4, one_bucket()).step_s == pytest.approx(0.1 + comm - 0.04, rel=REL)
    assert predict("ring", c.with_(overlap_s=1.0), 4, one_bucket()).step_s == pytest.approx(0.1, rel=REL)
    assert predict("ps", c.with_(overlap_s=1.0), 4, one_bucket()).step_s == pytest.approx(0.1, rel=REL)  # no comm
    # ps pushes per bucket during backward, as DDP's buckets: the same hiding; async's push waits for
    # its reply: none
    cp = costs(compute_s=0.1, rpc_overhead_s=1e-2)  # 6 messages at P = 4: 0.06 s
    for name, over in (("ps", 0.04), ("ps_flat", 0.04), ("ps", 1.0)):
        assert predict(name, cp.with_(overlap_s=over), 4, one_bucket()).step_s == pytest.approx(
            0.1 + 0.06 - min(0.06, over), rel=REL)  # fmt: skip
    assert predict("async", cp.with_(overlap_s=1.0), 4, one_bucket()).step_s == pytest.approx(0.1 + 0.07, rel=REL)
    assert cluster_costs(Cluster(overlap=0.5), c).overlap_s == pytest.approx(0.5 * 2 / 3 * 256 / 2470)


def test_ring_bf16_sends_half_the_bytes_in_the_same_messages() -> None:
    c = costs(intra=Link(1e-3, 1e9), ring_segment_bytes=math.inf)
    fp32, bf16 = predict("ring", c, 4, one_bucket()), predict("ring_bf16", c, 4, one_bucket())
    assert bf16.busiest_sent_bytes == pytest.approx(0.5 * 2 * 3 / 4 * D, rel=REL)
    assert bf16.messages == fp32.messages == 6
    assert bf16.step_s == pytest.approx(6 * 1e-3 + 0.5 * 2 * 3 / 4 * D / 1e9, rel=REL)


def test_tensor_parallel_splits_compute_and_all_reduces_each_activation_over_the_group() -> None:
    # T = P = 4, one node: 3/4 of the compute split, 2 activation payloads of 8 MiB, 1 GB/s, 1 ms per message
    c = costs(compute_s=0.1, intra=Link(1e-3, 1e9), gloo_segment_bytes=math.inf)
    work = Workload(grad_bytes=D, tensor_collectives=(8 * MIB, 8 * MIB), tensor_split_share=0.75)
    got = predict("tensor", c, 4, work)
    compute = 0.1 * (0.75 + 4 * 0.25)  # 4x the batch; the split 3/4 on a quarter of the weights
    comm = 2 * (2 * 3 * 1e-3 + 2 * 3 * (2 * MIB) / 1e9)  # two rings of 2(T-1) steps of 8 MiB / 4
    whole = 2 * 3 * 1e-3 + 2 * 3 * (0.25 * D / 4) / 1e9  # the unsplit quarter of D: a ring over all 4, one bucket
    assert got.step_s == pytest.approx(compute + comm + whole, rel=REL)
    assert got.busiest_sent_bytes == pytest.approx(2 * 2 * 3 / 4 * 8 * MIB + 2 * 3 / 4 * 0.25 * D, rel=REL)
    assert got.messages == 12 + 6 and got.nic_bytes == 0.0
    # 2 groups of 2 over 2 nodes of 2: the activations stay in the node; a rank's shards (3/4 D / T) in the
    # replicas' ring, which crosses it, and the gradients left whole (1 - s of D) in a ring over all 4
    two = predict("tensor", c.with_(local_size=2, inter=Link(0.0, 1e9), inter_shared=True), 4, Workload(
        grad_bytes=D, tensor_size=2, tensor_collectives=(8 * MIB,), tensor_split_share=0.75))  # fmt: skip
    shards, whole = 0.75 * D / 2, 0.25 * D
    assert two.phases["allreduce"] == pytest.approx(2 * 1 * 2 * (shards / 2) / 1e9, rel=REL)  # 2 rings share the NIC
    # 16 MiB whole in one bucket: 2(P-1) = 6 steps of a quarter of it across the inter-node link (latency 0, 1 GB/s)
    assert two.phases["replicated"] == pytest.approx(6 * whole / 4 / 1e9, rel=REL)
    assert two.busiest_sent_bytes == pytest.approx(2 * 1 / 2 * 8 * MIB + 2 * 1 / 2 * shards + 2 * 3 / 4 * whole,
                                                   rel=REL)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of T=3"):
        predict("tensor", c, 4, Workload(grad_bytes=D, tensor_size=3))


def test_tensor_parallel_pays_dtensor_dispatch_per_split_layer_and_reduces_the_whole_gradients_over_all() -> None:
    # T = P = 2 on one node of 2 cores: 3 split layers at 0.5 ms each; 4 KiB left whole (a row layer's bias)
    c = costs(compute_s=0.01, intra=Link(1e-4, 1e9), gloo_segment_bytes=math.inf, cores=2.0, tensor_layer_s=5e-4)
    work = Workload(grad_bytes=D, tensor_collectives=(MIB,), tensor_layers=3, tensor_replicated_bytes=4096.0)
    got = predict("tensor", c, 2, work)
    assert got.phases["dispatch"] == pytest.approx(3 * 5e-4, rel=REL)
    # the whole gradients: one bucket, 2(P-1) = 2 messages of half of it, over both processes (no replicas)
    assert got.phases["replicated"] == pytest.approx(2 * 1e-4 + 2 * 2048 / 1e9, rel=REL)
    assert "allreduce" not in got.phases and got.messages == 2 + 2
    bare = predict("tensor", c.with_(tensor_layer_s=0.0), 2, Workload(grad_bytes=D, tensor_collectives=(MIB,)))
    assert got.step_s - bare.step_s == pytest.approx(3 * 5e-4 + 2 * 1e-4 + 2 * 2048 / 1e9, rel=1e-9)


def test_ddp_buckets_are_1_mib_then_25_mib() -> None:
    assert ddp_buckets(1.5 * MIB) == [MIB, 0.5 * MIB]
    assert ddp_buckets(52 * MIB) == [MIB, 25 * MIB, 25 * MIB, MIB]
    assert sum(ddp_buckets(97.5 * MIB)) == 97.5 * MIB
    # every bucket is its own all-reduce: its own 2(P-1) latency steps
    c = costs(intra=Link(1e-3, math.inf), gloo_segment_bytes=math.inf, bucket_bytes=25 * MIB, first_bucket_bytes=MIB)
    assert predict("ddp", c, 2, one_bucket(52 * MIB)).step_s == pytest.approx(4 * 2 * 1e-3, rel=REL)


def test_flat_ring_across_nodes_runs_at_the_inter_node_link() -> None:
    c = costs(local_size=8, intra=Link(1e-6, 1e12), inter=Link(1e-3, 1e9), ring_segment_bytes=math.inf)
    got = predict("ring", c, 16, one_bucket())
    assert got.step_s == pytest.approx(2 * 15 * 1e-3 + 2 * 15 / 16 * D / 1e9, rel=REL)
    assert got.nic_bytes == pytest.approx(2 * 15 / 16 * D, rel=REL)  # one flow leaves each node


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 8), (128, 8)])
def test_hierarchical_inter_node_bytes_are_2_n_minus_1_over_n_of_data_over_local(nodes: int, local: int) -> None:
    got = predict("ring_hier", costs(local_size=local), nodes * local, one_bucket())
    inter_per_worker = 2 * (nodes - 1) / nodes * D / local  # the formula
    assert got.nic_bytes == pytest.approx(local * inter_per_worker, rel=REL)
    assert got.busiest_sent_bytes == pytest.approx(2 * (local - 1) / local * D + inter_per_worker, rel=REL)
    flat = predict("ring", costs(local_size=local), nodes * local, one_bucket())
    # the node's NIC carries about as much as a flat ring's (2(M-1)/M D against 2(P-1)/P D) ...
    world = nodes * local
    assert got.nic_bytes / flat.nic_bytes == pytest.approx((nodes - 1) / nodes / ((world - 1) / world), rel=REL)


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (128, 8)])
def test_hierarchical_latency_term_is_2_l_minus_1_plus_2_m_minus_1_against_2_p_minus_1(nodes: int, local: int) -> None:
    alpha = 1e-5
    c = costs(local_size=local, intra=Link(alpha, math.inf), inter=Link(alpha, math.inf), ring_segment_bytes=math.inf)
    world = nodes * local
    hier = predict("ring_hier", c, world, one_bucket())
    flat = predict("ring", c, world, one_bucket())
    assert hier.step_s == pytest.approx((2 * (local - 1) + 2 * (nodes - 1)) * alpha, rel=REL)
    assert flat.step_s == pytest.approx(2 * (world - 1) * alpha, rel=REL)
    assert hier.messages == 2 * (local - 1) + 2 * (nodes - 1)  # 268 against 2046 at 128 x 8


def test_hierarchical_rings_share_the_nodes_nic() -> None:
    beta = 1e9
    c = costs(local_size=8, inter=Link(0.0, beta), inter_shared=True)
    got = predict("ring_hier", c, 32, one_bucket())  # 4 nodes: 8 rings of D/8 leave each node at once
    assert got.step_s == pytest.approx(2 * 3 / 4 * D / beta, rel=REL)
