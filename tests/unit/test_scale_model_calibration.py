"""The scale model's constants (benchmarks/_scale_costs.py, _scale_cluster_model.py) against values worked out by hand.

Contention (busy processes over cores), the machine's costs recovered from the calibration figures and
pooled over worlds, the tiny pipeline's chunk overhead, a stated cluster's costs and workload, the ring
strategy's growing buckets, the strategies and layouts ``predict`` refuses, and the emulated cluster's
model (compute plus the NIC's bytes over its goodput plus latencies).
"""

from __future__ import annotations

import pytest
from _scale_model_cases import REL, D, costs, one_bucket

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
)
from lightning_strategies.advisor.model import MIB, Workload, contention, ddp_buckets, pipeline_makespan, predict

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
    from benchmarks._scale_compare import pooled_calibration, world_calibration

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
