"""The scale model (lightning_strategies/advisor/model.py, _scale_costs.py) against values worked out by hand.

Each test builds costs in which one term is isolated (every other constant 0 or infinitely fast), so
the prediction must equal the formula written out in the test. Tolerances: float arithmetic on a
handful of operations, rel=1e-12.
"""

from __future__ import annotations

import math

import pytest

from benchmarks._scale_costs import (
    CALIB_BIG,
    CALIB_SMALL,
    Cluster,
    cluster_costs,
    cluster_workload,
    effective_cores,
    hop_table,
    machine_costs,
    slower,
    solve_chunk_overhead,
)
from lightning_strategies.advisor.model import (
    MIB,
    Costs,
    Link,
    Workload,
    contention,
    ddp_buckets,
    pipeline_busy,
    pipeline_makespan,
    predict,
)
from lightning_strategies.advisor.push import push_traffic

REL = 1e-12
D = 64 * MIB  # gradient bytes of the tests' workload
FAST = Link(0.0, math.inf)


def costs(**kw: object) -> Costs:
    """Every cost 0 unless given; one node of 1024 processes unless ``local_size`` is given."""
    base = Costs(
        compute_s=0.0, local_size=1024, intra=FAST, inter=FAST, bucket_bytes=math.inf, first_bucket_bytes=math.inf
    )
    return base.with_(**kw)


def one_bucket(d: float = D) -> Workload:
    return Workload(grad_bytes=d)


# -- the rings -------------------------------------------------------------------------------


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


# -- parameter servers ------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 64, 1024])
def test_one_server_sends_p_minus_1_gradients_sharded_ps_what_a_ring_worker_sends(world: int) -> None:
    one = predict("ps_1", costs(), world, one_bucket())
    assert one.busiest_sent_bytes == pytest.approx((world - 1) * D, rel=REL)  # linear in P
    sharded = predict("ps", costs(), world, one_bucket())
    assert sharded.busiest_sent_bytes == pytest.approx(2 * (world - 1) / world * D, rel=REL)
    # the seed's claim: P^2 / (2(P-1)) times a ring worker's (sent only: (P-1) D against 2(P-1)/P D)
    ring = predict("ring", costs(), world, one_bucket())
    assert one.busiest_sent_bytes / ring.busiest_sent_bytes == pytest.approx(world / 2, rel=REL)


def test_one_server_bandwidth_term_grows_linearly_with_p() -> None:
    beta = 1e9
    c = costs(rpc_intra=Link(0.0, beta))
    for world in (2, 4, 8):
        # (P-1) D in, then (after the barrier) (P-1) D out, through the server's own link
        assert predict("ps_1", c, world, one_bucket()).step_s == pytest.approx(2 * (world - 1) * D / beta, rel=REL)
    # sharded: each rank sends D/P to each of P-1 peers, twice (pushes, replies)
    assert predict("ps", c, 4, one_bucket()).step_s == pytest.approx(2 * 3 * D / 4 / beta, rel=REL)


def test_one_server_runs_its_link_one_direction_at_a_time_at_the_one_way_goodput() -> None:
    # 4 nodes of 1: the server's node receives 3 D, then sends 3 D. The links are stated at the duplex
    # figure (each direction while both carry data): 0.5 of a one-way stream's 1e9 B/s here
    duplex, share = 0.5e9, 0.5
    c = costs(local_size=1, inter=Link(0.0, duplex), rpc_inter=Link(0.0, duplex), duplex_share=share)
    assert predict("ps_1", c, 4, one_bucket()).step_s == pytest.approx(2 * 3 * D / 1e9, rel=REL)
    # the sharded servers push and reply in both directions at once: the duplex figure, share or not
    flat = 2 * 3 * D / 4 / duplex  # 3 pushes of D/4 out, then 3 replies of D/4 out
    assert predict("ps_flat", c, 4, one_bucket()).step_s == pytest.approx(flat, rel=REL)
    assert predict("ps_flat", c.with_(duplex_share=1.0), 4, one_bucket()).step_s == pytest.approx(flat, rel=REL)
    # a ring the same: 2(P-1)/P D each way, at the duplex figure
    assert predict("ring", c, 4, one_bucket()).step_s == pytest.approx(2 * 3 / 4 * D / duplex, rel=REL)


def test_ps_messages_grow_with_p_and_cost_their_host_work() -> None:
    o = 1e-4
    c = costs(rpc_overhead_s=o)
    got = predict("ps", c, 64, one_bucket())
    assert got.messages == 2 * 63
    assert got.step_s == pytest.approx(2 * 63 * o, rel=REL)
    assert predict("ps_1", c, 64, one_bucket()).step_s == pytest.approx(2 * 63 * o, rel=REL)  # all at the server


def test_flat_ps_across_nodes_puts_l_times_a_rings_bytes_on_the_nic() -> None:
    c = costs(local_size=8)
    world = 64
    ps = predict("ps_flat", c, world, one_bucket())
    assert ps.nic_bytes == pytest.approx(2 * 8 * (world - 8) / world * D, rel=REL)
    ring = predict("ring", c, world, one_bucket())
    assert ps.nic_bytes / ring.nic_bytes == pytest.approx(8 * (world - 8) / (world - 1), rel=REL)
    # async on nodes of one process (and on one node) keeps the flat push: the same bytes and messages
    flat_async = predict("async", costs(local_size=1), world, one_bucket())
    flat_ps = predict("ps_flat", costs(local_size=1), world, one_bucket())
    assert (flat_async.nic_bytes, flat_async.busiest_sent_bytes) == (flat_ps.nic_bytes, flat_ps.busiest_sent_bytes)
    assert flat_async.messages == 2 * 63 + 1  # and a refill every 2 steps
    assert ps.messages == 2 * 63


def test_flat_ps_is_todays_term_and_ps_on_one_node_is_flat() -> None:
    # every term at once, on 8 nodes of 8 (the formula path): the term written out as before issue 28
    o, alpha, beta, a, u = 1e-4, 1e-5, 1e9, 1e-11, 2e-11
    c = costs(compute_s=0.1, local_size=8, rpc_overhead_s=o, rpc_inter=Link(alpha, beta), rpc_intra=Link(alpha, 1e12),
              inter_shared=True, ps_average_s_per_byte=a, ps_update_s_per_byte=u)  # fmt: skip
    p = 64
    wire = 2 * 8 * (p - 8) * (D / p) / beta  # the node's 8 workers' off-node pushes (and replies) share the NIC
    host = D / p * u + p * D / p * a  # one update of D/P, P pushes averaged
    assert predict("ps_flat", c, p, one_bucket()).step_s == pytest.approx(0.1 + host + 2 * 63 * o + wire + 2 * alpha,
                                                                          rel=REL)  # fmt: skip
    for world in (2, 8):  # one node: no hierarchy, the flat push
        one, flat = predict("ps", c, world, one_bucket()), predict("ps_flat", c, world, one_bucket())
        assert (one.step_s, one.messages, one.busiest_sent_bytes) == (
            flat.step_s,
            flat.messages,
            flat.busiest_sent_bytes,
        )
    # one process per node: nothing to reduce in the node, the flat push (as the strategy's 4 x 1)
    c1 = c.with_(local_size=1)
    assert predict("ps", c1, 4, one_bucket()).step_s == predict("ps_flat", c1, 4, one_bucket()).step_s


def test_the_flat_exchange_runs_at_its_all_to_all_share_of_the_link_and_the_hierarchical_push_at_its_own() -> None:
    beta, share = 1e9, 0.8
    # 4 nodes of 1: each worker pushes 3 x D/4 and its shard answers 3 x D/4, at share x beta each way
    flat = costs(local_size=1, rpc_inter=Link(0.0, beta), inter_shared=True, all_to_all_share=share)
    for strategy in ("ps", "ps_flat", "async"):
        assert predict(strategy, flat, 4, one_bucket()).step_s == pytest.approx(2 * 3 / 4 * D / (share * beta), rel=REL)
        # 1: as one stream each way
        assert predict(strategy, flat.with_(all_to_all_share=1.0), 4, one_bucket()).step_s == pytest.approx(
            2 * 3 / 4 * D / beta, rel=REL
        )
    # the hierarchical push (nodes of 8) does not run at the flat exchange's share: one flow per local rank and
    # remote node, at hier_push_share (1: as one stream each way)
    hier = costs(local_size=8, rpc_inter=Link(0.0, beta), inter_shared=True, all_to_all_share=share)
    assert predict("ps", hier, 32, one_bucket()).step_s == pytest.approx(2 * 3 / 4 * D / beta, rel=REL)
    for strategy in ("ps", "async"):
        got = predict(strategy, hier.with_(hier_push_share=0.5), 32, one_bucket())
        assert got.phases["bandwidth"] == pytest.approx(2 * 3 / 4 * D / (0.5 * beta), rel=REL)
    assert predict("ps_flat", hier.with_(hier_push_share=0.5), 32, one_bucket()).phases["bandwidth"] == pytest.approx(
        predict("ps_flat", hier, 32, one_bucket()).phases["bandwidth"], rel=REL)  # fmt: skip


def test_rings_between_nodes_run_at_their_ring_share_of_the_link_and_inside_a_node_at_its_rate() -> None:
    beta, share = 1e9, 0.8
    # 4 nodes of 1, one bucket: a ring of 2(P-1) steps of D/4 between nodes, at share x beta
    across = costs(local_size=1, inter=Link(0.0, beta), gloo_segment_bytes=math.inf, ring_share=share)
    for strategy in ("ddp", "ring"):
        want = 2 * 3 / 4 * D / (share * beta)
        assert predict(strategy, across, 4, one_bucket()).step_s == pytest.approx(want, rel=REL)
    # ring_hier on 2 nodes of 2: inside the node at the intra rate (L-1 = 1 step each way of D/2), between the
    # nodes one ring per local rank on D/4, both leaving the node at once: 2 flows at share x beta
    hier = costs(local_size=2, intra=Link(0.0, beta), inter=Link(0.0, beta), inter_shared=True,
                 ring_segment_bytes=math.inf, ring_share=share)  # fmt: skip
    got = predict("ring_hier", hier, 4, one_bucket())
    assert got.phases["bandwidth"] == pytest.approx(2 * (D / 2) / beta + 2 * 2 * (D / 4) / (share * beta), rel=REL)
    # tensor T = 4 over 4 nodes: its activation rings cross the link at the share; a group inside a node does not
    work = Workload(grad_bytes=D, tensor_collectives=(8 * MIB,))
    assert predict("tensor", across, 4, work).phases["bandwidth"] == pytest.approx(
        2 * 3 * 2 * MIB / (share * beta), rel=REL)  # fmt: skip
    inside = costs(intra=Link(0.0, beta), ring_share=share)
    assert predict("tensor", inside, 4, work).phases["bandwidth"] == pytest.approx(2 * 3 * 2 * MIB / beta, rel=REL)


# -- the hierarchical push (issue 28): reduce-scatter in the node, 1/L of it pushed across nodes --------


def test_the_hierarchical_push_on_gloo_sums_the_node_with_a_whole_all_reduce_then_all_gathers() -> None:
    # 2 nodes of 2, one bucket (DDP's caps at infinity), the node's link 1 GB/s and 1 ms a message, one segment:
    # NCCL: a reduce-scatter and an all-gather, (L-1) + (L-1) = 2 steps of D/2; gloo: an all-reduce of the
    # whole buffer (2(L-1) = 2 steps) and the all-gather, 3 steps
    c = costs(local_size=2, intra=Link(1e-3, 1e9), gloo_segment_bytes=math.inf)
    nccl = predict("ps", c, 4, one_bucket()).phases["node"]
    gloo = predict("ps", c.with_(node_all_reduce=True), 4, one_bucket()).phases["node"]
    assert nccl == pytest.approx(2 * (1e-3 + (D / 2) / 1e9), rel=REL)
    assert gloo == pytest.approx(3 * (1e-3 + (D / 2) / 1e9), rel=REL)
    # and the bytes a worker sends: 2(L-1)/L x D inside the node (NCCL), 3(L-1)/L x D (gloo), plus its push and
    # reply to the one remote shard of its chunk, D/P each
    assert predict("ps", c, 4, one_bucket()).busiest_sent_bytes == pytest.approx(2 / 2 * D + 2 * D / 4, rel=REL)
    got = predict("ps", c.with_(node_all_reduce=True), 4, one_bucket()).busiest_sent_bytes
    assert got == pytest.approx(3 / 2 * D + 2 * D / 4, rel=REL)
    # async pushes once per step: the whole gradient in one buffer, whatever DDP's buckets
    bucketed = c.with_(node_all_reduce=True, bucket_bytes=D / 4, first_bucket_bytes=D / 4)
    assert predict("async", bucketed, 4, one_bucket()).phases["node"] == pytest.approx(gloo, rel=REL)
    assert predict("ps", bucketed, 4, one_bucket()).phases["node"] == pytest.approx(
        gloo + 3 * 3e-3, rel=REL)  # ps pushes per bucket: 4 of D/4, a message per step each  # fmt: skip


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 8), (32, 8), (128, 8)])
def test_hierarchical_ps_puts_the_hierarchical_rings_bytes_on_the_nic(nodes: int, local: int) -> None:
    world = nodes * local
    got = predict("ps", costs(local_size=local), world, one_bucket())
    ring = predict("ring_hier", costs(local_size=local), world, one_bucket())
    # local rank j pushes D/P to the N-1 remote shards {n L + j} and its shard answers N-1 pushers
    assert got.messages == 2 * (nodes - 1)
    inter_per_worker = 2 * (nodes - 1) * D / world  # = 2(N-1)/N x D/L
    assert got.inter_sent_bytes == pytest.approx(inter_per_worker, rel=REL)
    assert got.inter_sent_bytes == pytest.approx(ring.inter_sent_bytes, rel=REL)
    assert got.nic_bytes == pytest.approx(2 * (nodes - 1) / nodes * D, rel=REL)
    assert got.nic_bytes == pytest.approx(ring.nic_bytes, rel=REL)
    # in the node: the reduce-scatter and the all-gather, 2(L-1)/L x D, as ring_hier's
    assert got.busiest_sent_bytes == pytest.approx(ring.busiest_sent_bytes, rel=REL)
    assert got.link_bytes == pytest.approx(ring.link_bytes, rel=REL)
    flat = predict("ps_flat", costs(local_size=local), world, one_bucket())
    assert flat.nic_bytes / got.nic_bytes == pytest.approx(
        local * (world - local) / world * nodes / (nodes - 1), rel=REL
    )
    assert flat.messages / got.messages == pytest.approx((world - 1) / (nodes - 1), rel=REL)


def test_hierarchical_ps_bandwidth_and_messages_terms() -> None:
    beta, o = 1e9, 1e-4
    # 4 nodes of 8: the node's 8 workers push 3 x D/32 each at once through its NIC, then the replies
    c = costs(local_size=8, rpc_inter=Link(0.0, beta), inter_shared=True)
    assert predict("ps", c, 32, one_bucket()).step_s == pytest.approx(2 * 3 / 4 * D / beta, rel=REL)
    assert predict("ring_hier", costs(local_size=8, inter=Link(0.0, beta), inter_shared=True), 32,
                   one_bucket()).step_s == pytest.approx(2 * 3 / 4 * D / beta, rel=REL)  # fmt: skip
    # host work per message: 2(N-1) against 2(P-1)
    co = costs(local_size=8, rpc_overhead_s=o)
    assert predict("ps", co, 64, one_bucket()).step_s == pytest.approx(2 * 7 * o, rel=REL)
    assert predict("ps_flat", co, 64, one_bucket()).step_s == pytest.approx(2 * 63 * o, rel=REL)
    # a push and its reply cross the inter-node link once each
    cl = costs(local_size=8, rpc_inter=Link(1e-5, math.inf))
    assert predict("ps", cl, 64, one_bucket()).step_s == pytest.approx(2 * 1e-5, rel=REL)


def test_hierarchical_ps_reduces_in_the_node_with_the_backends_ring_and_its_barrier_waits_for_n() -> None:
    alpha, beta, r = 1e-5, 1e10, 1e-12
    # 2 nodes of 4: the backend's reduce-scatter and all-gather over 4 (2 x 3 steps of D/4; no comm.ring overhead)
    c = costs(local_size=4, intra=Link(alpha, beta), gloo_segment_bytes=math.inf, ring_overhead_s=1.0,
              reduce_s_per_byte=r)  # fmt: skip
    got = predict("ps", c, 8, one_bucket())
    assert got.phases["node"] == pytest.approx(2 * 3 * alpha + 2 * 3 * (D / 4) / beta + 3 * (D / 4) * r, rel=REL)
    assert got.step_s == pytest.approx(got.phases["node"], rel=REL)
    # a shard averages N pushes (one per node) of its D/P, not P
    a = 1e-11
    ca = costs(local_size=8, ps_average_s_per_byte=a)
    assert predict("ps", ca, 64, one_bucket()).phases["host"] == pytest.approx(8 * D / 64 * a, rel=REL)
    assert predict("ps_flat", ca, 64, one_bucket()).phases["host"] == pytest.approx(64 * D / 64 * a, rel=REL)


def test_hierarchical_ps_needs_whole_nodes() -> None:
    with pytest.raises(ValueError, match=r"whole nodes: found P=12 with 8 per node.*ps_flat"):
        predict("ps", costs(local_size=8), 12, one_bucket())
    assert predict("ps_flat", costs(local_size=8), 12, one_bucket()).messages == 2 * 11


def test_push_traffic_by_hand() -> None:
    t = push_traffic(16, 4, 1600.0)  # 4 nodes of 4: shard s holds 100 B
    assert (t.hierarchical, t.nodes, t.pushers, t.peers_on_node, t.peers_off_node) == (True, 4, 4, 0, 3)
    assert (t.message_bytes, t.messages, t.inter_sent_bytes, t.nic_bytes) == (100.0, 6, 600.0, 2400.0)
    assert t.node_bytes == 2 * 3 / 4 * 1600 and t.sent_bytes == 600.0 + 2400.0
    f = push_traffic(16, 4, 1600.0, hierarchical=False)
    assert (f.pushers, f.peers_on_node, f.peers_off_node, f.messages, f.nic_bytes) == (16, 3, 12, 30, 4 * 2400.0)
    one = push_traffic(1, 8, 1600.0)
    assert (one.messages, one.sent_bytes, one.link_bytes, one.nic_bytes) == (0, 0.0, 0.0, 0.0)


def test_async_refills_its_lease_every_half_lease_and_rank_0_serves_every_workers_refills() -> None:
    o = 1e-3
    c = costs(rpc_overhead_s=o, compute_s=0.05)
    small = predict("async", c, 4, one_bucket())
    assert small.bound == "worker"
    # pushes and replies, and a refill (request + answer) every 2 steps of a 4-batch lease
    assert small.step_s == pytest.approx(0.05 + (2 * 3 + 1) * o, rel=REL)
    assert predict("async", c.with_(async_lease=8), 4, one_bucket()).messages == 2 * 3 + 0.5
    c0 = c.with_(compute_s=0.0)
    big = predict("async", c0, 1024, one_bucket())
    assert big.bound == "coordinator"
    # rank 0: its own 2(P-1) + 1 messages and the other workers' refills, 1 message each per step
    assert big.step_s == pytest.approx((2 * 1023 + 1 + 1023) * o, rel=REL)


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 8), (32, 8), (128, 8)])
def test_hierarchical_async_puts_the_hierarchical_rings_bytes_on_the_nic(nodes: int, local: int) -> None:
    # the node is the worker: ps's hierarchical traffic, and a refill (request + answer) every 2 steps
    world = nodes * local
    got = predict("async", costs(local_size=local), world, one_bucket())
    ps = predict("ps", costs(local_size=local), world, one_bucket())
    assert got.messages == 2 * (nodes - 1) + 1
    assert got.inter_sent_bytes == pytest.approx(2 * (nodes - 1) * D / world, rel=REL)
    assert got.nic_bytes == pytest.approx(2 * (nodes - 1) / nodes * D, rel=REL)
    assert (got.nic_bytes, got.busiest_sent_bytes, got.link_bytes) == (ps.nic_bytes, ps.busiest_sent_bytes,
                                                                       ps.link_bytes)  # fmt: skip
    flat = predict("ps_flat", costs(local_size=local), world, one_bucket())
    assert flat.nic_bytes / got.nic_bytes == pytest.approx(local * (world - local) / world * nodes / (nodes - 1),
                                                           rel=REL)  # fmt: skip


def test_hierarchical_async_terms_by_hand() -> None:
    alpha, beta, r, o, u = 1e-5, 1e10, 1e-12, 1e-4, 2e-11
    # 2 nodes of 4: the backend's reduce-scatter and all-gather over 4 (2 x 3 steps of D/4), as ps's
    c = costs(local_size=4, intra=Link(alpha, beta), gloo_segment_bytes=math.inf, reduce_s_per_byte=r)
    got = predict("async", c, 8, one_bucket())
    assert got.phases["node"] == pytest.approx(2 * 3 * alpha + 2 * 3 * (D / 4) / beta + 3 * (D / 4) * r, rel=REL)
    assert got.step_s == pytest.approx(got.phases["node"], rel=REL)
    # the leader's draw shared in a node of 8: its size and its bytes, each log2(8) = 3 hops
    cc = costs(local_size=8, rpc_intra=Link(alpha, math.inf))
    assert predict("async", cc, 64, one_bucket()).phases["node_control"] == pytest.approx(2 * 3 * alpha, rel=REL)
    # a shard applies the N = 8 node pushes of its D/P alone (P = 64 flat: 64 of them)
    cu = costs(local_size=8, ps_update_s_per_byte=u)
    assert predict("async", cu, 64, one_bucket()).phases["host"] == pytest.approx(8 * D / 64 * u, rel=REL)
    assert predict("async", cu.with_(local_size=1), 64, one_bucket()).phases["host"] == pytest.approx(
        64 * D / 64 * u, rel=REL
    )
    # host work per message: 2(N-1) pushes and replies and a refill every 2 steps; rank 0 also answers
    # the other N-1 nodes' refills (one message each per step): 15 o against 22 o, so with 0.05 s of
    # compute the worker sets the pace, without it the coordinator
    co = costs(local_size=8, rpc_overhead_s=o, compute_s=0.05)
    worker = predict("async", co, 64, one_bucket())
    assert (worker.bound, worker.step_s) == ("worker", pytest.approx(0.05 + (2 * 7 + 1) * o, rel=REL))
    bound = predict("async", co.with_(compute_s=0.0), 64, one_bucket())
    assert (bound.bound, bound.step_s) == ("coordinator", pytest.approx((2 * 7 + 1 + 7) * o, rel=REL))


# -- pipeline -------------------------------------------------------------------------------


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


# -- parameter servers with a measured transport ---------------------------------------------------


def test_ps_with_a_measured_transport_adds_it_and_the_protocol_per_peer() -> None:
    c = costs(compute_s=0.1, cores=2.0, rpc_exchange_s=0.02, rpc_gather_s=0.05, ps_protocol_s=1e-3)
    # P = 4 on 2 cores: compute twice as long; the exchange as measured (its own contention in it)
    assert predict("ps", c, 4, one_bucket()).step_s == pytest.approx(2 * 0.1 + 0.02 + 3 * 1e-3, rel=REL)
    assert predict("ps_1", c, 4, one_bucket()).step_s == pytest.approx(2 * 0.1 + 0.05 + 3 * 1e-3, rel=REL)
    # async: the same transport, its 3 peers' hand-offs and a refill (a round trip) every 2 steps
    got = predict("async", c, 4, one_bucket())
    assert got.step_s == pytest.approx(2 * 0.1 + 0.02 + (3 + 0.5) * 1e-3, rel=REL)
    assert got.phases["transport"] == 0.02
    # the formula path is untouched without a measured transport
    assert "transport" not in predict("ps", c.with_(rpc_exchange_s=None), 4, one_bucket()).phases
    assert slower(c, 2.0).rpc_exchange_s == pytest.approx(0.04)  # copies on loopback: CPU work


# -- contention and calibration -----------------------------------------------------------------


def test_contention_is_busy_processes_over_cores() -> None:
    assert contention(4, 2.0) == 2.0
    assert contention(1, 2.0) == 1.0
    assert contention(3, 1.5) == 2.0
    assert contention(64, None) == 1.0  # one device each
    assert effective_cores(4, alone_s=0.1, together_s=0.2) == 2.0
    assert effective_cores(2, alone_s=0.1, together_s=0.5) == 1.0  # never below one lone process
    # never above the machine's cores: 4 processes "as fast together as alone" on 2 cores is the probe's error
    assert effective_cores(4, alone_s=0.0027, together_s=0.0026) == pytest.approx(4 * 27 / 26)
    assert effective_cores(4, alone_s=0.0027, together_s=0.0026, cpus=2) == 2.0
    assert effective_cores(4, alone_s=0.1, together_s=0.4, cpus=2) == 1.0
    c = costs(compute_s=0.1, cores=2.0)
    assert predict("ddp", c, 4, one_bucket()).step_s == pytest.approx(0.2, rel=REL)


def test_machine_costs_recover_the_links_from_the_calibration_figures() -> None:
    alpha, beta, gloo = 50e-6, 2e9, 30e-6
    rpc_o, rpc_beta = 200e-6, 4e9
    tensors, d = 10, 4e6
    # ps host work: per tensor 1, 2, 3 us (client, average, update), per byte 1, 2, 3 ns
    update_t, two_t, local_t = tensors * 3e-6, tensors * (3e-6 + 2 * 2e-6), tensors * (3e-6 + 1e-6)
    calib = {
        "compute_s": 0.04,
        "compute_all_s": 0.04,  # two free cores at P = 2
        "exchange_small_s": alpha + CALIB_SMALL / beta,
        "exchange_big_s": CALIB_BIG / beta,
        "gloo_tiny_allreduce_s": 2 * gloo,
        "ring_tiny_s": 2 * (gloo + 40e-6),  # comm.ring adds 40 us per message
        "add_big_s": CALIB_BIG * 1e-10,
        "rpc_small_s": 2e-6,
        "rpc_big_s": 2 * CALIB_BIG / rpc_beta,
        "ps_update_tiny_s": update_t,
        "ps_two_tiny_s": two_t,
        "ps_local_tiny_s": local_t,
        "ps_update_s": update_t + d * 3e-9,
        "ps_two_s": two_t + d * (3e-9 + 2 * 2e-9),
        "ps_local_s": local_t + d * (3e-9 + 1e-9),
        # 2 ranks, 2 shards: client over every tensor, update of half, averaging of 2 pushes of half
        "ps_pair_tiny_s": tensors * (1e-6 + 3e-6 / 2 + 2e-6) + 2 * rpc_o,
        "pipeline_tiny_s": 2 * (4 + 1) * 1e-4,  # M + K - 1 slots each way, 100 us of runtime work each
        "microbatches": 4.0,
        "rpc_exchange_s": 0.02,
        "rpc_gather_s": 0.05,
        "rpc_exchange_tiny_s": 50e-6,
    }
    got = machine_costs(calib, 2, tensors=tensors, grad_bytes=d)
    assert got.cores == 2.0
    assert got.intra.bandwidth == pytest.approx(beta)
    assert got.intra.latency_s == pytest.approx(gloo)
    assert got.ring_overhead_s == pytest.approx(40e-6)
    assert got.reduce_s_per_byte == pytest.approx(1e-10)
    assert got.rpc_overhead_s == pytest.approx(rpc_o)
    assert got.rpc_intra.bandwidth == pytest.approx(rpc_beta)
    for part, k in (("client", 1), ("average", 2), ("update", 3)):
        assert getattr(got, f"ps_{part}_s_per_tensor") == pytest.approx(k * 1e-6)
        assert getattr(got, f"ps_{part}_s_per_byte") == pytest.approx(k * 1e-9)
    assert got.chunk_overhead_s == pytest.approx(1e-4)
    assert got.rpc_exchange_s == 0.02
    assert got.rpc_gather_s == 0.05
    # the tiny push_pull less its host work (2 rpc_o of messages) and its transport
    assert got.ps_protocol_s == pytest.approx(2 * rpc_o - 50e-6)
    assert got.hop_s == ()  # no wake-up figures: the link's latency
    with_wakes = machine_costs({**calib, "wake_0_s": 1e-4, "wake_1_s": 3e-4}, 2, tensors=tensors, grad_bytes=d)
    assert with_wakes.hop_s == (1e-4, 3e-4)
    assert hop_table({"wake_0_s": 1.0, "wake_1_s": 2.0, "wake_2_s": 3.0}, 2) == (1.0, 2.0)  # b < P only
    # a world without RPC: the RPC constants keep their defaults (and the other way round)
    coll = machine_costs(
        {k: v for k, v in calib.items() if not k.startswith(("rpc_", "ps_"))}, 2, tensors=tensors, grad_bytes=d
    )
    assert coll.rpc_exchange_s is None and coll.ring_overhead_s == pytest.approx(40e-6)
    rpc_only = {k: v for k, v in calib.items() if k not in ("exchange_big_s", "pipeline_tiny_s")}
    assert machine_costs(rpc_only, 2, tensors=tensors, grad_bytes=d).chunk_overhead_s == 0.0
    # a probe taken when the machine runs 1.5x slower and P = 2 get one core between them
    probed = machine_costs(calib, 2, tensors=tensors, grad_bytes=d, probe={"alone_s": 0.06, "all_s": 0.12})
    assert probed.compute_s == pytest.approx(0.06)
    assert probed.cores == 1.0
    assert probed.intra.bandwidth == pytest.approx(beta / 1.5)
    assert probed.ps_update_s_per_tensor == pytest.approx(1.5 * 3e-6)
    # latencies enter as measured (their typical value over the run), not scaled by the probe
    assert probed.intra.latency_s == pytest.approx(gloo)
    assert probed.rpc_overhead_s == pytest.approx(rpc_o)
    assert probed.ring_overhead_s == pytest.approx(40e-6)
    # the runtime's work per chunk is work (the model's chunks; the waits are the hops'): it slows
    assert probed.chunk_overhead_s == pytest.approx(1.5 * 1e-4)
    assert probed.rpc_exchange_s == pytest.approx(1.5 * 0.02)
    assert slower(got, 2.0).ps_update_s_per_byte == pytest.approx(6e-9)


def test_cluster_costs_state_the_links_in_bytes_per_second() -> None:
    cluster = Cluster()
    c = cluster_costs(cluster, costs(rpc_overhead_s=1e-4, ring_overhead_s=2e-5))
    assert c.inter.bandwidth == 100e9 / 8  # 100 Gb/s
    assert c.intra.bandwidth == 300e9
    assert c.compute_s == pytest.approx(256 / 2470)  # NVIDIA's 2470 img/s at batch 256
    assert c.rpc_overhead_s == pytest.approx(1e-4, rel=REL)  # calibrated here unless given
    assert c.ring_overhead_s == pytest.approx(2e-5, rel=REL)
    assert cluster_costs(Cluster(rpc_overhead_us=50.0), c).rpc_overhead_s == pytest.approx(50e-6)
    assert c.cores is None
    work = cluster_workload(cluster)
    assert work.grad_bytes == 4 * 25_557_032
    # a replica takes K x 256 images, in M micro-batches, bf16 activations
    assert work.activation_bytes == 2 * 512 * 28 * 28 * 4 * 256 / 8


def test_the_ring_strategys_buckets_grow_with_p_as_comm_ring_does() -> None:
    from benchmarks._scale_costs import RING_MIN_CHUNK_BYTES
    from lightning_strategies.comm.ring import MIN_CHUNK_BYTES, ring_bucket_cap_mb

    assert RING_MIN_CHUNK_BYTES == MIN_CHUNK_BYTES
    c = costs(bucket_bytes=25 * MIB, first_bucket_bytes=MIB, min_chunk_bytes=MIN_CHUNK_BYTES)
    for world in (8, 100, 256, 1024):
        cap = ring_bucket_cap_mb(25.0, world) * MIB
        assert c.buckets(100 * MIB, world, grow=True) == ddp_buckets(100 * MIB, cap, MIB)
    # 256 x 256 KiB = 64 MiB buckets at P = 256: 3 ring calls (1 + 64 + 35 MiB) instead of DDP's 5
    assert len(c.buckets(100 * MIB, 256, grow=True)) == 3
    assert len(c.buckets(100 * MIB, 256)) == 5


def test_unknown_strategy_and_uneven_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'tree'"):
        predict("tree", costs(), 4, one_bucket())
    with pytest.raises(ValueError, match="whole nodes"):
        predict("ring_hier", costs(local_size=4), 6, one_bucket())
    with pytest.raises(ValueError, match="multiple of K=4"):
        predict("pipeline", costs(), 6, Workload(grad_bytes=D, stages=4))


def test_the_chunk_overhead_is_the_tiny_pipelines_cpu_time_per_chunk_when_measured() -> None:
    from benchmarks._scale_costs import pipeline_chunk_overhead

    # CPU seconds per stage of M = 4 micro-batches: 2M chunks
    assert pipeline_chunk_overhead({"pipeline_tiny_cpu_s": 8e-4, "pipeline_tiny_s": 1.0}, 4, (), 2.0) == 1e-4
    wall = pipeline_makespan(2, 4, 2e-4, 2e-4, cores=2.0)  # 10 chunks of 200 us, no hops
    assert pipeline_chunk_overhead({"pipeline_tiny_s": wall}, 4, (), 2.0) == pytest.approx(2e-4, rel=1e-9)
    assert pipeline_chunk_overhead({}, 4, (), 2.0) == 0.0


def test_calibration_pools_pair_figures_over_worlds_without_rpc_and_not_with_it() -> None:
    from benchmarks.scale import pooled_calibration, world_calibration

    def row(world: int, compute_all: float, tiny: float, wake: float) -> dict[str, float]:
        return {"calib/compute_all_s": compute_all, "calib/gloo_tiny_allreduce_s": tiny, "calib/wake_0_s": wake}

    rows = {
        "coll/P2": [row(2, 0.04, 1e-4, 1e-4), row(2, 0.05, 9e-4, 2e-4)],
        "coll/P4": [row(4, 0.08, 2e-4, 3e-4), row(4, 0.09, 3e-4, 4e-4)],
        "rpc/P4": [row(4, 0.10, 5e-4, 5e-4), row(4, 0.12, 7e-4, 7e-4)],
    }
    # work figures: the least disturbed (minimum); latencies (wake-ups, tiny calls): the median
    assert pooled_calibration(rows["coll/P2"]) == {
        "compute_all_s": 0.04, "gloo_tiny_allreduce_s": pytest.approx(5e-4), "wake_0_s": pytest.approx(1.5e-4),
    }  # fmt: skip
    assert pooled_calibration(rows["coll/P2"], latency_median=False)["wake_0_s"] == 1e-4
    # a repetition's hops are taken at the quietest repetition's speed (its compute alone against
    # the least disturbed), as the probe before each step scales them back
    slow = [{**rows["coll/P2"][0], "calib/compute_s": 0.02}, {**rows["coll/P2"][1], "calib/compute_s": 0.04}]
    assert pooled_calibration(slow)["wake_0_s"] == pytest.approx((1e-4 + 2e-4 / 2) / 2)
    coll = world_calibration(rows, "coll", 4)
    assert coll["compute_all_s"] == 0.08  # all P at once: the world's own
    assert coll["gloo_tiny_allreduce_s"] == pytest.approx(2.5e-4)  # a pair's: median over both coll worlds
    assert coll["wake_0_s"] == pytest.approx(2.5e-4)
    rpc = world_calibration(rows, "rpc", 4)  # every figure the world's own: P pollers in each
    assert rpc == pooled_calibration(rows["rpc/P4"])


# --- the emulated cluster's model (benchmarks/_scale_cluster_model.py) ---


def test_cluster_step_is_compute_plus_nic_bytes_over_goodput_plus_latencies() -> None:
    from benchmarks._scale_cluster_model import critical_messages, predict_step

    # ring at 2 x 2: 2(P-1) = 6 messages; D = 5.25 MB, 1.5 D through the NIC at 25 MB/s, 50 us one way
    assert critical_messages("ring", 2, 2) == 6
    cell = predict_step(0.1, 1.5 * 5.25e6, 25e6, 6, 50e-6)
    assert cell.comm_s == pytest.approx(7.875e6 / 25e6 + 6 * 50e-6, rel=1e-12)  # 0.315 + 0.0003
    assert cell.step_s == pytest.approx(0.1 + 0.3153, rel=1e-12)
    assert cell.comm_bound  # 0.3153 of 0.4153
    assert not predict_step(0.4, 1e6, 25e6, 2, 0.0).comm_bound  # 0.04 of 0.44


def test_cluster_compute_is_the_fast_runs_step_less_its_link_term_never_negative() -> None:
    from benchmarks._scale_cluster_model import calibrate_compute, comm_seconds, critical_messages, serial_directions

    # ps1 at 4 x 1 at 1gbit: 3 D = 15.75 MB at 118 MB/s + 2 x 30 us
    comm = comm_seconds(3 * 5.25e6, 118e6, critical_messages("ps1", 4, 1), 30e-6)
    assert comm == pytest.approx(15.75e6 / 118e6 + 60e-6, rel=1e-12)
    assert calibrate_compute(0.5, comm) == pytest.approx(0.5 - comm, rel=1e-12)
    assert calibrate_compute(0.1, comm) == 0.0  # a fast run quicker than its link term: no negative compute
    assert critical_messages("ring_hier", 2, 2) == 2 and critical_messages("tensor", 2, 2) == 24
    assert (serial_directions("ps1"), serial_directions("ps"), serial_directions("ring")) == (2, 1, 1)
    with pytest.raises(ValueError, match="found goodput"):
        comm_seconds(1.0, 0.0, 1, 0.0)
    with pytest.raises(ValueError, match="expected one of"):
        critical_messages("nope", 2, 2)
