"""The advisor's validation (``benchmarks/advisor_validation.py``, ``benchmarks/_session_costs.py``): a stored
session's costs under its probes, its own measurement, its cells' floors, against hand-computed values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_strategies.advisor import load_cluster, measure
from tests.unit.test_advisor import BATCH, Toy


def test_the_validation_predicts_stored_ps_runs_with_the_push_they_made() -> None:
    from benchmarks.advisor_validation import ps_push

    d = 5_316_672.0  # the emulated cluster's MLP gradient bytes
    # 2 x 2: the flat push puts 2L(P-L)/P = 2 D on a node's NIC (2.04 D measured with TCP's headers),
    # the hierarchical one 2(N-1)/N = 1 D
    assert ps_push([{"nic_bytes": 2.04 * d, "D": d}], "2x2") == "ps_flat"
    assert ps_push([{"nic_bytes": 1.02 * d, "D": d}], "2x2") == "ps"
    assert ps_push([{"nic_bytes": 1.52 * d, "D": d}], "4x1") == "ps"  # one process per node: flat either way


def test_the_validation_predicts_each_run_under_the_cpu_its_probe_found() -> None:
    from types import SimpleNamespace

    from benchmarks._session_costs import run_costs

    cluster = load_cluster("emulated_4x1_200mbit")
    m = SimpleNamespace(step_s=0.02)  # the MLP's step as measured here, with the probe here at 10 ms
    # the run's probe: 30 ms alone, 60 ms on its P = 4 at once; the least loaded probe of all 5 ms
    got = run_costs(cluster, m, {"probe": (0.030, 0.060)}, 0.010, 0.005)  # type: ignore[arg-type]
    quiet = cluster.costs(0.02)
    assert got.compute_s == pytest.approx(0.02 * 0.030 / 0.010)  # the measurement moved to the run's moment
    assert got.cores == pytest.approx(4 * 0.030 / 0.060)  # P x alone / together
    f = 0.030 / 0.005  # host work and wake-ups: the presets' quiet figures x run probe / floor
    assert got.hop_s == pytest.approx(tuple(h * f for h in quiet.hop_s))
    assert got.ps_update_s_per_tensor == pytest.approx(quiet.ps_update_s_per_tensor * f)
    assert got.intra.bandwidth == pytest.approx(quiet.intra.bandwidth / f)  # loopback: copies, CPU work
    assert got.inter == quiet.inter and got.rpc_inter == quiet.rpc_inter  # a shaped link: the network's
    assert run_costs(cluster, m, {"probe": (0.005, 0.005)}, 0.010, 0.005).cores == 4.0  # type: ignore[arg-type]
    # ... but never more cores than the machine the run ran on had (its file's header)
    capped = run_costs(cluster, m, {"probe": (0.005, 0.005), "cpus": 2}, 0.010, 0.005)  # type: ignore[arg-type]
    assert capped.cores == 2.0
    # a link probe: one stream 24e6 B/s alone, the slower of a stream each way at once 18e6 B/s
    linked = run_costs(cluster, m, {"probe": (0.030, 0.060), "link": {"oneway": 24e6, "duplex_min": 18e6}},
                       0.010, 0.005)  # type: ignore[arg-type]  # fmt: skip
    assert linked.inter.bandwidth == linked.rpc_inter.bandwidth == 18e6
    assert linked.inter.latency_s == quiet.inter.latency_s
    assert linked.duplex_share == pytest.approx(0.75)


def test_a_message_probe_sets_the_sessions_latencies_and_slows_rpcs_host_work_as_its_round_trip() -> None:
    from types import SimpleNamespace

    from benchmarks._session_costs import quiet_rpc_round_trip_s, run_costs

    m = SimpleNamespace(step_s=0.02)
    probe = {"probe": (0.030, 0.060), "link": {"oneway": 24e6, "duplex_min": 18e6}}
    # 2 x 2: gloo 200 us per message inside a node, 300 us between nodes; RPC's round trip 1 ms inside a node,
    # 2.5 x the calibration's 400 us
    messages = {"gloo_intra": 200e-6, "gloo_inter": 300e-6, "rpc_intra": 1e-3, "rpc_inter": 1.2e-3}
    cluster = load_cluster("emulated_2x2_1gbit")
    quiet = cluster.costs(0.02)
    got = run_costs(cluster, m, {**probe, "messages": messages}, 0.010, 0.005, 400e-6)  # type: ignore[arg-type]
    unprobed = run_costs(cluster, m, probe, 0.010, 0.005, 400e-6)  # type: ignore[arg-type]
    assert got.intra.latency_s == got.rpc_intra.latency_s == 200e-6
    assert got.inter.latency_s == got.rpc_inter.latency_s == 300e-6
    assert got.inter.bandwidth == 18e6  # the link probe's rate stays
    assert got.intra.bandwidth == unprobed.intra.bandwidth  # loopback's copies: the CPU's
    assert got.rpc_overhead_s == pytest.approx(quiet.rpc_overhead_s * 2.5)
    # the validation's own prediction leaves RPC's host work at the preset's (no round trip given)
    assert run_costs(cluster, m, {**probe, "messages": messages}, 0.010, 0.005).rpc_overhead_s == quiet.rpc_overhead_s  # type: ignore[arg-type]
    assert unprobed.rpc_overhead_s == quiet.rpc_overhead_s and unprobed.inter.latency_s == quiet.inter.latency_s
    assert (
        dataclasses.replace(
            got,
            intra=unprobed.intra,
            inter=unprobed.inter,
            rpc_intra=unprobed.rpc_intra,
            rpc_inter=unprobed.rpc_inter,
            rpc_overhead_s=unprobed.rpc_overhead_s,
        )
        == unprobed
    )
    # 4 x 1: no pair inside a node; the round trip between nodes less the wire's (2 x 48.6 us and 8 KiB at 18e6 B/s)
    four = load_cluster("emulated_4x1_1gbit")
    inter = {"gloo_inter": 300e-6, "rpc_inter": 1.2e-3}
    got = run_costs(four, m, {**probe, "messages": inter}, 0.010, 0.005, 400e-6)  # type: ignore[arg-type]
    host = 1.2e-3 - 2 * four.latency_us * 1e-6 - 2 * 4096 / 18e6
    assert got.rpc_overhead_s == pytest.approx(four.costs(0.02).rpc_overhead_s * host / 400e-6)
    assert got.inter.latency_s == 300e-6
    # the calibration's bare 4 KiB round trip on the quiet machine: rpc/P4's repetitions in scale_raw.json, by
    # hand: 379.2 308.8 375.0 389.4 309.5 308.7 us, median (309.5 + 375.0) / 2
    assert quiet_rpc_round_trip_s(4) == pytest.approx(342.25e-6, abs=0.1e-6)


def test_a_sessions_message_probes_count_once_per_cluster() -> None:
    from benchmarks._session_costs import session_cpu

    a, b, c = {"gloo_inter": 1.0, "rpc_inter": 4.0}, {"gloo_inter": 2.0, "rpc_inter": 5.0}, {"gloo_inter": 9.0}
    # cluster 1's probes (a before, b after) stored with each of its 3 fits; cluster 2's (c; its after failed: {})
    fits = [{"probe": (1.0, 2.0), "cpus": 2, "messages": [a, b]} for _ in range(3)]
    fits += [{"probe": (3.0, 4.0), "cpus": 2, "messages": [c, {}]}]
    cpu = session_cpu(json.loads(json.dumps(fits)))  # as stored: the clusters' probes no longer one object
    assert cpu["messages"] == {"gloo_inter": 2.0, "rpc_inter": 4.5}  # medians of (1, 2, 9) and (4, 5)
    assert cpu["probe"] == (1.0, 2.0) and "link" not in cpu  # every fit counts: (1, 1, 1, 3), (2, 2, 2, 4)
    assert "messages" not in session_cpu([{"probe": (1.0, 2.0), "cpus": 2}])  # stored before the probe


def test_the_busy_variant_takes_the_latency_between_nodes_timed_while_the_others_computed() -> None:
    from types import SimpleNamespace

    from benchmarks._session_costs import busy_between_nodes, run_costs

    cpu = {"probe": (0.030, 0.060), "messages": {"gloo_intra": 2e-4, "gloo_inter": 3e-4, "gloo_inter_busy": 9e-4}}
    busy = busy_between_nodes(cpu)
    got = run_costs(load_cluster("emulated_2x2_1gbit"), SimpleNamespace(step_s=0.02), busy, 0.01, 0.005)  # type: ignore[arg-type]
    assert got.inter.latency_s == got.rpc_inter.latency_s == 9e-4 and got.intra.latency_s == 2e-4
    assert cpu["messages"]["gloo_inter"] == 3e-4  # the session's own figures are left as they were
    # a probe stored before the busy exchange was timed, or no probe at all: nothing to swap
    assert busy_between_nodes({"probe": (1.0, 2.0), "messages": {"gloo_inter": 3e-4}})["messages"]["gloo_inter"] == 3e-4
    assert busy_between_nodes({"probe": (1.0, 2.0)}) == {"probe": (1.0, 2.0)}


def test_the_validation_reads_each_runs_machine_cores_from_its_files_header() -> None:
    from benchmarks._common import header
    from benchmarks.advisor_validation import header_cpus, stored_runs

    assert header_cpus("# advisor_cluster: x | x86_64, 2 cores, no GPU | torch 2.14.1 | 2026-12-03") == 2
    assert header_cpus(header("t")) >= 1
    with pytest.raises(ValueError, match="found no ', <n> cores,'"):
        header_cpus("# a header without the machine")
    runs, _ = stored_runs()
    assert runs and all(r["cpus"] == 2 for rs in runs.values() for r in rs)  # every stored run: this machine


def test_a_sessions_cores_are_bounded_by_its_machines() -> None:
    from benchmarks._mlp_measurement import to_json
    from benchmarks.advisor_validation import step_lines

    m = measure(Toy(), BATCH)
    # every fit's probe: as fast on 4 processes at once as alone, 4 cores, on a 2-core machine
    run = {"probe": (1e-3, 1e-3), "cpus": 2, "wall_s": 0.1, "steps_s": [0.1, 0.1], "measurement": to_json(m)}
    lines = step_lines(m, {f"{s}|2x2|1gbit": [run, run] for s in ("ddp", "ring")}, 1e-3)
    assert "advisor_probe_cores_2x2_1gbit 2 cores" in lines


def test_a_session_is_predicted_from_its_own_fits_measurement_where_each_stored_one() -> None:
    from benchmarks._mlp_measurement import from_json, to_json
    from benchmarks._session_costs import at_speed, session_measurement

    m = measure(Toy(), BATCH)
    assert from_json(json.loads(json.dumps(to_json(m)))) == m  # as advisor_cluster.py stores it
    with pytest.raises(ValueError, match="a stored measurement with keys"):
        from_json({**to_json(m), "nope": 1})
    # three fits: their measurements at 2, 3 and 5 x the Toy's, their probes 1, 1 and 2 ms: ratios 2, 3, 2.5 x
    fits = ((2, 1e-3), (3, 1e-3), (5, 2e-3))
    session = [{"probe": (p, 0.0), "measurement": to_json(at_speed(m, f))} for f, p in fits]
    got, probe, source = session_measurement(session, m, 7e-3)
    assert got == at_speed(m, 5) and probe == 2e-3 and source == "its fits'"  # the median ratio, with its probe
    # a fit without one (stored before): the measurement here and its probe
    assert session_measurement([*session, {"probe": (1e-3, 0.0)}], m, 7e-3) == (m, 7e-3, "here")


def test_the_together_probe_counts_the_waits_for_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks._compute_probe as probe

    # a clock that moves 1 s per reading, and 50 s more inside the second timed step (a wait for a core)
    ticks = iter(range(1, 100))
    readings: list[float] = []

    def clock() -> float:
        readings.append(next(ticks) + (50.0 if len(readings) >= 6 else 0.0))
        return readings[-1]

    monkeypatch.setattr(probe.time, "perf_counter", clock)
    assert probe.mlp_step_s(5, width=8, layers=1) == 1.0  # the median step: the wait hidden
    readings.clear()
    ticks = iter(range(1, 100))
    # readings: 2 untimed steps' starts (1, 2), the timed steps' begin (3), then start, end per step (4-13),
    # the end (14): (14 + 50 - 3) / 5 steps
    assert probe.mlp_step_s(5, width=8, layers=1, whole=True) == pytest.approx(61 / 5)


def test_the_validation_moves_the_pipelines_stage_times_with_the_probe_as_the_compute() -> None:
    from types import SimpleNamespace

    from benchmarks._session_costs import at_speed, run_costs
    from benchmarks.advisor_validation import workload

    m = measure(Toy(), BATCH)
    cluster = load_cluster("emulated_4x1_200mbit")
    slow = at_speed(m, 3.0)
    assert slow.step_s == pytest.approx(3 * m.step_s)
    assert [b.forward_fixed_s for b in slow.blocks] == pytest.approx([3 * b.forward_fixed_s for b in m.blocks])
    assert (slow.grad_bytes, slow.saved_bytes, slow.tensor_payloads) == (m.grad_bytes, m.saved_bytes, m.tensor_payloads)
    # the run's probe 3 x the probe here: the costs' compute and the pipeline's stages (taken from the
    # measurement's blocks, not from Costs.compute_s) move alike
    costs = run_costs(cluster, SimpleNamespace(step_s=m.step_s), {"probe": (0.030, 0.060)}, 0.010, 0.005)  # type: ignore[arg-type]
    assert costs.compute_s == pytest.approx(slow.step_s)
    stages, got = workload(m, "pipeline", 4), workload(slow, "pipeline", 4)
    assert got.stage_seconds == pytest.approx(tuple(3 * s for s in stages.stage_seconds or ()))
    assert got.stage_compute_s == pytest.approx(3 * (stages.stage_compute_s or 0.0))


def test_the_validation_predicts_from_the_measurement_whose_ratio_to_its_probe_is_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import benchmarks.advisor_validation as validation

    m = measure(Toy(), BATCH)
    # five measurements, each between two probes of 1 ms: the compute at 3, 1, 5, 2, 4 x the Toy's
    made = iter((3.0, 1.0, 5.0, 2.0, 4.0))
    monkeypatch.setattr(validation, "mlp_step_s", lambda reps: 1e-3)
    monkeypatch.setattr(validation, "mlp_measurement", lambda *a, **k: validation.at_speed(m, next(made)))
    got, here, ratios, shares = validation.measure_here(5)
    assert here == 1e-3 and got.step_s == pytest.approx(3 * m.step_s)  # the median of 1 .. 5
    assert ratios == pytest.approx([f * m.step_s / 1e-3 for f in (3, 1, 5, 2, 4)])
    # a micro-batch's share of the batch does not move with the CPU's speed; by hand from the blocks' lines
    by_hand = sum(sum(m.block_seconds(i, 8)) for i in range(len(m.blocks))) / m.step_s
    assert shares == pytest.approx([by_hand] * 5)


def test_the_validation_holds_wall_time_per_step_and_each_cells_floor_is_its_rounds_spread() -> None:
    from benchmarks.advisor_validation import measured_s, rounds_floor

    assert measured_s({"step_s": 1.0, "wall_s": 1.5}) == 1.5  # what a user waits for, not ps's step timer
    with pytest.raises(ValueError, match="without wall_s"):
        measured_s({"step_s": 1.0})
    assert rounds_floor([{"wall_s": 0.9}, {"wall_s": 1.1}]) == pytest.approx(0.2 / 1.0)  # (max - min) / median
    # one round: its timed steps' first half against the second, |1.0 - 1.2| / median 1.1
    assert rounds_floor([{"wall_s": 2.0, "steps_s": [1.0, 1.0, 1.2, 1.2]}]) == pytest.approx(0.2 / 1.1)
