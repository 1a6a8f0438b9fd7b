"""The scale model's parameter servers (lightning_strategies/advisor/model.py, push.py) against hand-worked values.

ps (P shards with the hierarchical or the flat push), ps_1 (one server) and async: their bytes per link,
messages and host work, the hierarchical push of issue 28 (reduce-scatter in the node, 1/L of it pushed
across nodes), async's lease refills, and ps with a measured transport. Each test isolates one term in
its costs (``_scale_model_cases.costs``: every other constant 0 or infinitely fast); rel=1e-12.
"""

from __future__ import annotations

import math

import pytest
from _scale_model_cases import REL, D, costs, one_bucket

from benchmarks._scale_costs import slower
from lightning_strategies.advisor.model import MIB, Link, Workload, predict
from lightning_strategies.advisor.push import push_traffic

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
