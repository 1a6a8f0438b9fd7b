"""The advisor against the emulated cluster's stored runs (``results/advisor_cluster_*.json``) and real fits' memory.

For each layout (2x2, 4x1) and rate (1gbit, 200mbit, 50mbit) the advisor predicts every strategy of
``advisor_cluster.py``'s runs for their MLP (``benchmarks/emulated/_fit.py``: 1.31 M parameters, batch 32
per replica, SGD) on the matching preset (``conf/cluster/emulated_<layout>_<rate>.yaml``), from what
it measures of the MLP here (``advisor.measure``, timed on this machine) and the presets' figures:
nothing is fitted to the stored steps. The pipeline and tensor runs are predicted as they ran
(K = P stages, M = 4K micro-batches, 1F1B; T = P).

The load. On this shared 2-vCPU machine other jobs take a share of the cores that changes from minute to
minute: the MLP's step alone took 2.9-40 ms in the runs' probes at load 5-21, and a latency-bound step (the
pipeline's 32 hops per stage) slows with it. The stored runs and this script run at different moments, so
each run stores a probe taken right before its fit (the MLP's step alone and on P processes at once,
``_compute_probe``) and the advisor's own measurement of the MLP taken with it (``_mlp_measurement``). A
session (one layout and rate, its ~18 fits) is predicted from its fits' measurements, the one whose ratio to
its probe is the median (:func:`session_measurement`); a session whose fits stored none (runs stored before)
from a measurement here, taken 5 times between two probes each (:func:`measure_here`). One probe alone is
mostly noise (a probe is shorter than the scheduler's time slices): the session's median probe stands for
the CPU its runs had. Each session is predicted under it (:func:`run_costs`): the measurement moved to the
session's moment (x its probe / the measurement's own probe), the cores its P processes shared (P x alone /
together, at most the machine's cores), the presets' host figures and wake-ups (a quiet machine's,
``scale.txt``) slowed by its probe over the quiet machine's (``QUIET_PROBE_S``, or a lower probe if one is
stored); a shaped link's rate is left as it is (``benchmarks/_session_costs.py``). Where a session's clusters
took the message probe (``advisor_cluster.message_probe``, stored since 2026-12-04), a gloo message's latency
inside a node and between nodes is the probes' median instead of the presets' (the same quantity the
calibration timed on loopback); ``..._preset_latency`` lines give each such cell's error with the presets'
latencies, and ``advisor_step_error_max_message_probed_rpc_round_trip`` what RPC's host work slowed as the
probe's RPC round trip would give and ``..._busy_latency`` gloo's latency between nodes timed while the other
ranks computed (neither adopted). The 4x1 presets' ``all_to_all_share``
(``cluster_exchange.py``: the flat ps / async exchange's goodput over one stream's, 0.77-0.85) applies to
the session's probed link; ``..._one_stream`` lines give the flat ps's and async's error without it (1: as
one stream each way).
``advisor_predicted_preset_step_s_*`` is the preset alone (2 cores, quiet host figures) with the
compute measured here: what a user of ``ls-advise`` gets.

What is predicted: the wall time per step of each stored run (its timed window's wall time over its
steps, the gaps between steps included), what a user waits for. ps's own step timer stops before the
replies that land during the next step, so its step time flatters ps, ps1 and async; the wall time
does not. The measurement's own floor is the same fit measured again: ``advisor_cluster.py`` runs
every cell in 2 rounds (fresh clusters, interleaved), and a cell's floor is the spread of its rounds.

Lines:

    advisor_measured_wall_s_per_step_<strategy>_<layout>_<rate>   s, the rounds' median
    advisor_predicted_step_s_<strategy>_<layout>_<rate>   s
    advisor_step_error_<strategy>_<layout>_<rate>          |predicted - measured| / measured; ``..._floor``:
                                                           that cell's (max - min) / median over its rounds;
                                                           ``..._one_stream`` (flat ps, async): the link
                                                           probe's stream as their link, not the all-to-all's
    advisor_step_error_max_<layout>_<rate>, advisor_step_error_max            goal <= 0.15
    advisor_step_error_max_floor, ..._median_floor         the cells' floors
    advisor_step_error_within_goal_or_floor                the share of cells within 0.15 or their own floor
    advisor_rank_kendall_tau_<layout>_<rate>               the predicted order against the measured one;
                                                           ``..._floor``: round 0's order against round 1's
    advisor_rank_kendall_tau_min                                              goal >= 0.8
    advisor_probe_alone_ms_*, advisor_probe_cores_*        the CPU: the probe alone (per run, and a session's
                                                           median), P x alone / together (a session's)
    advisor_message_us_<kind>_<layout>_<rate>              the message probe's medians (``gloo_intra``,
                                                           ``gloo_inter``, ``gloo_inter_busy``: per message;
                                                           ``rpc_*``: a 4 KiB round trip)
    advisor_step_error_<cell>_preset_latency               a probed session's cell with the presets' latencies
    advisor_step_error_{max,median}_message_probed[_preset_latency|_rpc_round_trip|_busy_latency]   the probed
                                                           sessions' cells: as predicted, with the presets'
                                                           latencies, with RPC's host work x the probe's round
                                                           trip / the quiet one, with ``gloo_inter_busy``
    advisor_predicted_preset_step_s_*, advisor_step_error_preset_max   the presets alone (no probe)
    advisor_measured_over_probe_here, ..._spread           the measurement here over its probe (the one used;
                                                           (max - min) / median over the 5)
    advisor_measured_microbatch_share, ..._spread          a micro-batch of 8 rows over the batch, the stages'
                                                           charge (the one used; the 5's spread)

    python benchmarks/advisor_validation.py          # writes results/advisor_validation.txt (~2 min)
    python benchmarks/advisor_validation.py --quick  # narrower models, nothing written (CI, ~1 min)
    python benchmarks/advisor_validation.py --name advisor_validation_again  # the same at another moment

Memory (``_advisor_memory.py``): the digits ResNet and the wide MLP fitted under ddp, ps, pipeline
(K = 2, 4) and tensor (T = 2), each rank's tensors read before every optimizer step and at the end
(``_rank_memory.RankMemory``, the machinery of ``pipeline_memory.py``), against the advisor's
parameters + gradients + optimizer state of that rank (a pipeline's stage s on rank s); the
activations and communication buffers of its peak are freed by then, so they are printed next to the
busiest rank's peak RSS growth, not held to the goal:

    advisor_memory_predicted_mib_<model>_<config>_rank<r>, ..._measured_mib_...   MiB
    advisor_memory_error_<model>_<config>    max over ranks |predicted - measured| / measured (frac)
    advisor_memory_error_max                                                  goal <= 0.10
    advisor_memory_peak_predicted_mib_<model>_<config>   the busiest rank's whole peak (+ activations,
                                                         buffers), next to
    advisor_memory_rss_growth_mib_<model>_<config>       its peak RSS over the baseline at setup
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _advisor_memory
from benchmarks._common import header, line, load_line, median, spread
from benchmarks._compute_probe import mlp_step_s
from benchmarks._mlp_measurement import mlp_measurement
from benchmarks._rank_memory import map_large_allocations
from benchmarks._session_costs import (
    QUIET_PROBE_S,
    at_speed,
    busy_between_nodes,
    median_by_ratio,
    quiet_rpc_round_trip_s,
    run_costs,
    session_cpu,
    session_measurement,
)
from lightning_strategies.advisor import load_cluster
from lightning_strategies.advisor.advise import model_key, strategy_workload
from lightning_strategies.advisor.costs import Costs, Workload
from lightning_strategies.advisor.measure import Measurement
from lightning_strategies.advisor.model import predict
from lightning_strategies.advisor.push import push_traffic

RESULTS = Path(__file__).parent / "results"
STEP_GOAL, TAU_GOAL, MEMORY_GOAL = 0.15, 0.8, 0.10
# a message-probed session's cells predicted four ways, by their lines' suffix: as the validation predicts (its
# gloo latencies), and three not adopted (docs/advisor.md): the presets' latencies, RPC's host work also slowed as
# the probe's RPC round trip, gloo's latency between nodes the one timed while the other ranks computed
MESSAGE_VARIANTS = {"": "its gloo latencies", "_preset_latency": "the presets' latencies",
                    "_rpc_round_trip": "RPC's host work x its round trip",
                    "_busy_latency": "the busy latency between nodes"}  # fmt: skip
LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1)}
RATES = ("1gbit", "200mbit", "50mbit")
MEASURE_ROUNDS = 5  # the measurement here, each between two probes (:func:`measure_here`)
STRATEGIES = ("ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps1", "ps_ring", "async", "pipeline", "tensor")
RUNS = "advisor_cluster_*.json"  # benchmarks/advisor_cluster.py's stored runs, one file per rate


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two score lists over the same items (+1: the same order)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
                for i, j in pairs)  # fmt: skip
    return score / len(pairs) if pairs else 1.0


def ps_push(runs: Sequence[dict], layout: str) -> str:
    """The scale model's key for stored ``ps`` runs: which push they made, read from their bytes (the
    runs stored before issue 28's hierarchical push pushed flat). A node's NIC carries 2L(P-L)/P x D
    per step with the flat push (``ps_flat``), 2(N-1)/N x D with the hierarchical one (``ps``)."""
    nodes, per_node = LAYOUTS[layout]
    got = median([r["nic_bytes"] / r["D"] for r in runs])
    flat = push_traffic(nodes * per_node, per_node, 1.0, hierarchical=False).nic_bytes
    hier = push_traffic(nodes * per_node, per_node, 1.0).nic_bytes
    return "ps_flat" if abs(got - flat) < abs(got - hier) else "ps"


def workload(m: Measurement, strategy: str, world: int) -> Workload:
    """What the runs ran: batch 32 per replica; the pipeline K = P stages, M = 4K; tensor T = P; ps_ring's shards
    each step 1/P of the optimizer."""
    return strategy_workload(m, strategy, 32, num_stages=world, microbatches=4 * world, tp_size=world, world=world)


def measure_here(rounds: int) -> tuple[Measurement, float, list[float], list[float]]:
    """The MLP measured ``rounds`` times (``advisor.measure``), each between two probes (the probe the runs took,
    longer: one figure). The stored runs are predicted from the measurement's ratio to its probe, and on this
    shared machine other tenants' share of the CPU moves within seconds: the round whose ratio is the median,
    with its probe, every round's ratio (the script's own spread) and its micro-batch share
    (:func:`microbatch_share`: what the pipeline's stages are charged)."""
    got: list[tuple[Measurement, float]] = []
    for _ in range(rounds):
        before = mlp_step_s(31)
        m = mlp_measurement()
        got.append((m, (before + mlp_step_s(31)) / 2))
    m, here = median_by_ratio(got)
    return m, here, [g.step_s / p for g, p in got], [microbatch_share(g) for g, _ in got]


def microbatch_share(m: Measurement, rows: int = 8) -> float:
    """A micro-batch of ``rows`` (the runs' pipeline: K x 32 / M = 8) over the batch: forward and backward of
    every block on the line through the batch's and the quarter batch's times (what the stages are charged)."""
    return sum(sum(m.block_seconds(i, rows)) for i in range(len(m.blocks))) / m.step_s


def predicted(m: Measurement, strategy: str, layout: str, rate: str, costs: Costs | None = None) -> float:
    """The step of ``strategy`` on the preset (``costs``: the preset's under a run's CPU; default the
    preset's own, a quiet machine's)."""
    cluster = load_cluster(f"emulated_{layout}_{rate}")
    costs = costs or cluster.costs(m.step_s)
    return predict(model_key(strategy), costs, cluster.world, workload(m, strategy, cluster.world)).step_s


def stored_runs() -> tuple[dict[str, list[dict]], list[str]]:
    """Every stored run by ``strategy|layout|rate`` and the files' headers; each run gets ``cpus``, the cores of
    the machine it ran on (its file's header: ``x86_64, 2 cores``)."""
    runs: dict[str, list[dict]] = {}
    headers = []
    for path in sorted(RESULTS.glob(RUNS)):
        raw = json.loads(path.read_text())
        headers.append(f"{path.name}: {raw['header'].lstrip('# ')}")
        cpus = header_cpus(raw["header"])
        for key, rs in raw["runs"].items():
            runs.setdefault(key, []).extend({**r, "cpus": cpus} for r in rs)
    return runs, headers


def header_cpus(text: str) -> int:
    """The cores a results header names (``benchmarks._common.header``: ``| x86_64, 2 cores, no GPU |``)."""
    found = re.search(r", (\d+) cores,", text)
    if not found:
        raise ValueError(f"found no ', <n> cores,' in the header {text[:200]!r}: expected benchmarks._common.header's")
    return int(found.group(1))


def memory_lines(rows: list[_advisor_memory.Row]) -> list[str]:
    out = []
    for row in rows:
        tag = f"{row.model}_{row.config}"
        for r, (pred, got) in enumerate(zip(row.predicted, row.ranks, strict=True)):
            out.append(line(f"advisor_memory_predicted_mib_{tag}_rank{r}", _advisor_memory.state(pred) / 2**20, "MiB"))
            out.append(line(f"advisor_memory_measured_mib_{tag}_rank{r}", got["tensor_mib"], "MiB"))
        out.append(line(f"advisor_memory_error_{tag}", row.error, "frac"))
        busiest = max(range(len(row.ranks)), key=lambda i: row.predicted[i].total)
        out.append(line(f"advisor_memory_peak_predicted_mib_{tag}", row.predicted[busiest].total / 2**20, "MiB"))
        out.append(line(f"advisor_memory_rss_growth_mib_{tag}", row.ranks[busiest]["growth_mib"], "MiB"))
    worst = max(rows, key=lambda r: r.error)
    out.append(line("advisor_memory_error_max", worst.error, "frac"))
    fixed = [g["growth_mib"] - p.total / 2**20 for row in rows for p, g in zip(row.predicted, row.ranks, strict=True)]
    out.append(f"# memory: worst {worst.model}_{worst.config} ({worst.error:.4f}); goal <= {MEMORY_GOAL}: "
               f"{'met' if worst.error <= MEMORY_GOAL else 'MISSED'}. Peak RSS growth exceeds the predicted peak by "
               f"{min(fixed):.1f}-{max(fixed):.1f} MiB per process (gloo, Lightning, the autograd engine, the "
               "allocator), more than these models' own 1-30 MiB: on CPU at these sizes RSS measures the process, "
               "not the strategy, so it is printed, not held to the goal")  # fmt: skip
    print(out[-1], flush=True)
    return out


def measured_s(run: dict) -> float:
    """What the advisor predicts of a stored run: its wall time per step (the timed window's wall time over its
    steps, the gaps between steps included: what a user waits for). ps's own step timer stops before replies
    that land during the next step, so the step time alone flatters ps, ps1 and async."""
    if "wall_s" not in run:
        raise ValueError("a stored run without wall_s (stored before the wall line): found keys "
                         f"{sorted(run)}. Fix: run benchmarks/advisor_cluster.py again")  # fmt: skip
    return float(run["wall_s"])


def halves(steps: Sequence[float]) -> tuple[float, float]:
    """The medians of a run's first and second half of timed steps (a run of one step agrees with itself)."""
    half = max(1, len(steps) // 2)
    return median(steps[:half]), median(steps[half:] or steps)


def rounds_floor(cell: Sequence[dict]) -> float:
    """A cell's own spread: (max - min) / median of its rounds' wall times; with one round, |first half -
    second half| / median of its slowest rank's timed steps (the step timer's: the wall time is one figure)."""
    values = [measured_s(r) for r in cell]
    if len(values) > 1:
        return spread(values)
    a, b = halves(cell[0]["steps_s"])
    return abs(a - b) / median(cell[0]["steps_s"])


def variant_summary(name: str, pairs: Sequence[tuple[float, str]]) -> str:
    """One way of predicting the probed cells: how many are within the goal, their median error, the 3 worst."""
    worst = ", ".join(f"{t} {e:.2f}" for e, t in sorted(pairs, reverse=True)[:3])
    within_goal = sum(e <= STEP_GOAL for e, _ in pairs)
    return f"with {name} {within_goal} ({median([e for e, _ in pairs]):.3f}; {worst})"


def step_lines(m: Measurement, runs: dict[str, list[dict]], here: float) -> list[str]:
    """Predicted against measured wall time per step, per cell and in all, each next to its measured floor
    (the same fit's spread between rounds; for tau, round 0's order against round 1's)."""
    text: list[str] = []
    sessions = {k.split("|", 1)[1] for k in runs}
    floor_s = min([QUIET_PROBE_S, here, *(median([r["probe"][0] for k, rs in runs.items() if k.endswith(c) for r in rs])
                           for c in sessions)])  # fmt: skip
    text.append(line("advisor_probe_floor_ms", 1e3 * floor_s, "ms"))
    errors: list[tuple[float, str]] = []
    preset_errors: list[float] = []
    # the message-probed cells' errors with their cells, per MESSAGE_VARIANTS' suffix
    variants: dict[str, list[tuple[float, str]]] = {suffix: [] for suffix in MESSAGE_VARIANTS}
    taus: list[tuple[float, float, str]] = []
    floors: list[float] = []
    within = 0
    for layout, rate in itertools.product(LAYOUTS, RATES):
        cluster = load_cluster(f"emulated_{layout}_{rate}")
        session = [r for s in STRATEGIES for r in runs.get(f"{s}|{layout}|{rate}", [])]
        if not session:
            continue
        # a probe (9 steps in the runs stored before 2026-12-04, 31 since) is not much longer than the
        # scheduler's slices: one alone is mostly noise; the session's median (its fits' probes) is its CPU
        cpu = session_cpu(session)
        m_s, here_s, source = session_measurement(session, m, here)
        costs = run_costs(cluster, m_s, cpu, here_s, floor_s)
        # the MESSAGE_VARIANTS not adopted
        others = {
            "_preset_latency": run_costs(cluster, m_s, {k: v for k, v in cpu.items() if k != "messages"}, here_s,
                                         floor_s),
            "_rpc_round_trip": run_costs(cluster, m_s, cpu, here_s, floor_s, quiet_rpc_round_trip_s(cluster.world)),
            "_busy_latency": run_costs(cluster, m_s, busy_between_nodes(cpu), here_s, floor_s)}  # fmt: skip
        m_run = at_speed(m_s, cpu["probe"][0] / here_s)  # the measurement at the session's CPU, as costs.compute_s
        text.append(line(f"advisor_session_microbatch_share_{layout}_{rate}", microbatch_share(m_s), "x"))
        text.append(f"# {layout} {rate}: predicted from {source} measurement ({1e3 * m_s.step_s:.2f} ms, its probe "
                    f"{1e3 * here_s:.2f} ms)")  # fmt: skip
        if costs.all_to_all_share != 1.0:
            text.append(line(f"advisor_all_to_all_share_{layout}_{rate}", costs.all_to_all_share, "x"))
        text.append(line(f"advisor_probe_alone_ms_{layout}_{rate}", 1e3 * cpu["probe"][0], "ms"))
        text.append(line(f"advisor_probe_cores_{layout}_{rate}", costs.cores or 0.0, "cores"))
        if "link" in cpu:
            text.append(line(f"advisor_link_oneway_Bps_{layout}_{rate}", cpu["link"]["oneway"], "B/s"))
            text.append(line(f"advisor_link_duplex_share_{layout}_{rate}", costs.duplex_share, "x"))
        for kind, value in sorted(cpu.get("messages", {}).items()):
            text.append(line(f"advisor_message_us_{kind}_{layout}_{rate}", 1e6 * value, "us"))
        pred, meas, cell_errors, names = [], [], [], []
        by_round: dict[int, dict[str, float]] = {}
        for strategy in STRATEGIES:
            cell = runs.get(f"{strategy}|{layout}|{rate}")
            if not cell:
                continue
            key = ps_push(cell, layout) if strategy == "ps" else strategy
            got = median([measured_s(r) for r in cell])
            p = predicted(m_run, key, layout, rate, costs)
            preset = predicted(m, key, layout, rate)
            err, floor = abs(p - got) / got, rounds_floor(cell)
            tag = f"{strategy}_{layout}_{rate}"
            text.append(line(f"advisor_measured_wall_s_per_step_{tag}", got, "s"))
            text.append(line(f"advisor_predicted_step_s_{tag}", p, "s"))
            text.append(line(f"advisor_step_error_{tag}", err, "x"))
            text.append(line(f"advisor_step_error_{tag}_floor", floor, "x"))
            if costs.all_to_all_share != 1.0 and strategy in ("ps", "async"):  # as one stream each way
                one = predicted(m_run, key, layout, rate, costs.with_(all_to_all_share=1.0))
                text.append(line(f"advisor_step_error_{tag}_one_stream", abs(one - got) / got, "x"))
            if "messages" in cpu:
                errs = {
                    "": err,
                    **{s: abs(predicted(m_run, key, layout, rate, c) - got) / got for s, c in others.items()},
                }
                text.append(line(f"advisor_step_error_{tag}_preset_latency", errs["_preset_latency"], "x"))
                for suffix, e in errs.items():
                    variants[suffix].append((e, tag))
            text.append(line(f"advisor_predicted_preset_step_s_{tag}", preset, "s"))
            text.append(line(f"advisor_probe_alone_ms_{tag}", 1e3 * median([r["probe"][0] for r in cell]), "ms"))
            floors.append(floor)
            within += err <= max(STEP_GOAL, floor)
            cell_errors.append(err)
            errors.append((err, tag))
            preset_errors.append(abs(preset - got) / got)
            pred.append(p)
            meas.append(got)
            names.append(strategy)
            for i, r in enumerate(cell):
                by_round.setdefault(int(r.get("round", i)), {})[strategy] = measured_s(r)
        if len(pred) < 2:
            continue
        tau = kendall_tau(pred, meas)
        # the measurement's own tau: the strategies' order in round 0 against round 1 (those measured in both)
        both = [s for s in names if all(s in by_round.get(i, {}) for i in (0, 1))]
        if len(both) > 1:
            floor_tau = kendall_tau([by_round[0][s] for s in both], [by_round[1][s] for s in both])
        else:  # one round: the order of the runs' first halves of timed steps against their second halves
            split = [halves(runs[f"{s}|{layout}|{rate}"][0]["steps_s"]) for s in names]
            floor_tau = kendall_tau([a for a, _ in split], [b for _, b in split])
        text.append(line(f"advisor_step_error_max_{layout}_{rate}", max(cell_errors), "x"))
        text.append(line(f"advisor_rank_kendall_tau_{layout}_{rate}", tau, "tau"))
        text.append(line(f"advisor_rank_kendall_tau_{layout}_{rate}_floor", floor_tau, "tau"))
        taus.append((tau, floor_tau, f"{layout}_{rate}"))
    worst = max(errors)
    text.append(line("advisor_step_error_max", worst[0], "x"))
    text.append(line("advisor_step_error_median", median([e for e, _ in errors]), "x"))
    text.append(line("advisor_step_error_max_floor", max(floors), "x"))
    text.append(line("advisor_step_error_median_floor", median(floors), "x"))
    text.append(line("advisor_step_error_within_goal_or_floor", within / len(errors), "frac"))
    text.append(line("advisor_step_error_preset_max", max(preset_errors), "x"))
    if variants[""]:
        for suffix, pairs in variants.items():
            text.append(line(f"advisor_step_error_max_message_probed{suffix}", max(pairs)[0], "x"))
            text.append(line(f"advisor_step_error_median_message_probed{suffix}", median([e for e, _ in pairs]), "x"))
        text.append(f"# the {len(variants[''])} cells of the sessions with a message probe, within {STEP_GOAL} (median "
                    "error; the worst cells): "
                    + "; ".join(variant_summary(MESSAGE_VARIANTS[s], p) for s, p in variants.items()))  # fmt: skip
    lowest = min(taus)
    text.append(line("advisor_rank_kendall_tau_min", lowest[0], "tau"))
    text.append(line("advisor_rank_kendall_tau_min_floor", min(t[1] for t in taus), "tau"))
    over = ", ".join(f"{t} {e:.2f}" for e, t in sorted(errors, reverse=True) if e > STEP_GOAL) or "none"
    text.append(f"# worst step: {worst[1]} ({worst[0]:.3f}); goal <= {STEP_GOAL}: "
                f"{'met' if worst[0] <= STEP_GOAL else 'MISSED'}; {sum(e <= STEP_GOAL for e, _ in errors)} of "
                f"{len(errors)} cells within it, {within} within it or their own floor; over it: {over}")  # fmt: skip
    by = {s: sorted(e for e, t in errors if t.startswith(f"{s}_") and t[len(s) + 1] in "24") for s in STRATEGIES}
    text.append("# by strategy (error over its cells, min-max): "
                + ", ".join(f"{s} {v[0]:.2f}-{v[-1]:.2f}" for s, v in by.items() if v))  # fmt: skip
    text.append(f"# the floor: a cell's (max - min) / median wall time over its rounds (the same fit measured "
                f"again; with one round its timed steps' first half against the second): median {median(floors):.3f}, "
                f"max {max(floors):.3f}")  # fmt: skip
    text.append(f"# lowest tau: {lowest[2]} ({lowest[0]:.3f}); goal >= {TAU_GOAL}: "
                f"{'met' if lowest[0] >= TAU_GOAL else 'MISSED'}; that session's own floor (round 0's order "
                f"against round 1's; with one round, first halves against second) {lowest[1]:.3f}")  # fmt: skip
    text.append("# fitted: nothing. From stored files: the presets' link figures (results/scale_cluster.txt "
                "probes), the flat all-to-all's share of them (results/cluster_exchange.txt), host "
                "overheads and wake-ups (results/scale.txt calibration), each run's CPU probe "
                "(results/advisor_cluster_*.json); compute: measured here")  # fmt: skip
    for t in text[-5:]:
        print(t, flush=True)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="write nothing (CI)")
    parser.add_argument("--name", default="advisor_validation", help="results/<name>.txt (another moment's run)")
    args = parser.parse_args(argv)
    map_large_allocations()  # freed tensors leave the RSS (see _rank_memory)
    text = [header("advisor_validation: the advisor against results/advisor_cluster_*.json and real fits' memory")]
    print(text[0], flush=True)
    text.append(load_line("start"))
    # the fits fork their ranks from this process: before it runs autograd itself
    text.extend(memory_lines(_advisor_memory.run(args.quick)))
    # One thread, as every process of the stored runs, only now. A rank of these fits once aborted in autograd's
    # thread start with "pool INTERNAL ASSERT FAILED ... Invalid thread pool!" (in set_num_threads); the likely
    # cause: set here before the forks, set_num_threads creates torch's thread pool in this process, a forked
    # rank re-creates it lazily, and two of the rank's threads can race on that. The ranks set their own.
    torch.set_num_threads(1)
    runs, headers = stored_runs()
    text.extend(f"# measured: {h}" for h in headers)
    m, here, ratios, shares = measure_here(MEASURE_ROUNDS)
    text.append(line("advisor_measured_compute_s_mlp_batch32", m.step_s, "s"))
    text.append(line("advisor_measured_grad_bytes_mlp", m.grad_bytes, "bytes"))
    text.append(line("advisor_probe_here_ms", 1e3 * here, "ms"))
    text.append(line("advisor_measured_over_probe_here", m.step_s / here, "x"))
    text.append(line("advisor_measured_over_probe_spread", spread(ratios), "x"))
    text.append(line("advisor_measured_microbatch_share", microbatch_share(m), "x"))
    text.append(line("advisor_measured_microbatch_share_spread", spread(shares), "x"))
    text.append(f"# {len(ratios)} measurements here, each between two probes: measured over probe "
                + " ".join(f"{r:.3f}" for r in ratios) + "; a micro-batch of 8 rows over the batch "
                + " ".join(f"{r:.3f}" for r in shares) + " (the median ratio's measurement predicts)")  # fmt: skip
    print(text[-1], flush=True)
    if not runs:
        text.append(f"# no stored runs ({RUNS}): run benchmarks/advisor_cluster.py; no step figures")
        print(text[-1], flush=True)
    else:
        text.extend(step_lines(m, runs, here))
    text.append(load_line("end"))
    if not args.quick:
        (RESULTS / f"{args.name}.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
