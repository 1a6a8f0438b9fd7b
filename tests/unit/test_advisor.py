"""The advisor (lightning_strategies.advisor): a toy model's measured sizes against its known ones, the
memory formulas and the ranking against hand-computed values, the presets, the report's schema."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_strategies.advisor import (
    STRATEGIES,
    Cluster,
    NoStrategyFitsError,
    advise,
    load_cluster,
    measure,
    memory,
    preset_names,
    to_json,
    write_png,
)
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.measure import Block, Measurement, _time_each
from lightning_strategies.advisor.memory import pipeline_memory
from lightning_strategies.advisor.report import JSON_KEYS

GIB = 1 << 30


class Toy(pl.LightningModule):
    """8 -> 16 -> 16 -> 4 (ReLUs between): 484 float32 weights; its optimizer given by the test."""

    def __init__(self, opt: str = "adam") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.opt = opt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.opt == "adam":
            return torch.optim.Adam(self.parameters())
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9 if self.opt == "momentum" else 0.0)


PARAMS = 4 * (8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4)  # 1936 B
BATCH = (torch.randn(32, 8), torch.randn(32, 4))


def test_measure_counts_the_toy_models_bytes_per_tensor_and_per_block() -> None:
    toy = Toy()
    before = [p.detach().clone() for p in toy.parameters()]
    m = measure(toy, BATCH)
    assert all(torch.equal(a, b) for a, b in zip(before, toy.parameters(), strict=True))  # measured on a copy
    assert m.param_bytes == m.grad_bytes == PARAMS and len(m.tensors) == 6
    # Adam: exp_avg and exp_avg_sq per weight (2 x params) and a float32 step count per tensor
    assert m.optimizer == "Adam" and m.optimizer_bytes == 2 * PARAMS + 6 * 4
    assert measure(Toy("momentum"), BATCH).optimizer_bytes == PARAMS  # one momentum buffer
    assert measure(Toy("sgd"), BATCH).optimizer_bytes == 0
    # outputs at the block boundaries: 32 rows x 16, 16, 16, 16, 4 float32 values
    assert [b.output_bytes for b in m.blocks] == [32 * 16 * 4] * 4 + [32 * 4 * 4]
    # saved for backward: each Linear its input, each ReLU its output (32 x 8 the data, 32 x 16 the others)
    assert [b.saved_bytes for b in m.blocks] == [32 * 8 * 4] + [32 * 16 * 4] * 4
    # the tensor plan pairs net.0 / net.2 (colwise / rowwise): the ReLU between and net.2's input are split
    assert [b.split_saved_bytes for b in m.blocks] == [0, 2048, 2048, 0, 0]
    # net.2's output all-reduce, net.4's input-gradient all-reduce and its output gathered (half an all-reduce)
    assert m.tensor_payloads == (32 * 16 * 4, 32 * 16 * 4, 32 * 4 * 4 / 2)
    assert m.tensor_split_gcd == 4 and m.pipeline and m.step_s > 0
    # three split layers; left whole on every rank of a group: net.2's bias only (rowwise), 16 float32
    assert m.tensor_split_layers == 3 and m.tensor_replicated_bytes == 16 * 4
    tp = strategy_workload(m, "tensor", 32, tp_size=2)
    assert (tp.tensor_layers, tp.tensor_replicated_bytes) == (3, 16 * 4)


def test_a_stated_throughput_gives_counted_flops_over_it() -> None:
    m = measure(Toy(), BATCH, tflops=1.0, device="toy")
    # forward 2 x rows x in x out per Linear; backward twice that, except the first layer's input gradient
    fwd = 2 * 32 * (8 * 16 + 16 * 16 + 16 * 4)
    assert m.flops == pytest.approx(3 * fwd - 2 * 32 * 8 * 16, rel=0.02)  # + the loss's and ReLUs' few FLOPs
    assert m.step_s == pytest.approx(m.flops / 1e12, rel=1e-9) and "toy" in m.timed_on
    # counted FLOPs are in proportion to the rows: no fixed part
    assert all(b.forward_fixed_s == b.backward_fixed_s == 0.0 for b in m.blocks)


class _Sleepy(nn.Module):
    """A block whose forward takes ``fixed_s + per_row_s x rows`` (sleeps): a known line through 0 rows."""

    def __init__(self, fixed_s: float, per_row_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.fixed_s, self.per_row_s = fixed_s, per_row_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fixed_s + self.per_row_s * len(x))
        return x * self.weight


class SleepyPipe(Toy):
    def __init__(self) -> None:
        super().__init__("sgd")
        self.net = nn.Sequential(_Sleepy(0.020, 0.001), nn.Linear(4, 4))


def test_a_blocks_time_is_its_fixed_part_plus_the_rest_in_proportion_to_the_rows() -> None:
    # forward 20 ms + 1 ms a row: 52 ms at 32 rows, 28 ms at 8 (the quarter batch). A sleep overshoots by a
    # scheduler's wake-up (< 1 ms on a quiet machine; the median of 3 keeps a loaded moment's few ms out),
    # which moves the line's intercept by 4/3 of the overshoot at 8 rows: 20 ms +- 5 ms holds it.
    m = measure(SleepyPipe(), (torch.randn(32, 4), torch.randn(32, 4)))
    sleepy = m.blocks[0]
    assert sleepy.forward_s == pytest.approx(0.052, abs=0.005)
    assert sleepy.forward_fixed_s == pytest.approx(0.020, abs=0.005)
    assert m.block_seconds(0, 8)[0] == pytest.approx(0.028, abs=0.005)  # the line, not 52 / 4 = 13 ms
    assert m.block_seconds(0, 32) == (sleepy.forward_s, sleepy.backward_s)  # at the batch: as measured


def test_the_quarter_batch_is_timed_in_turn_with_the_batch() -> None:
    # the two sizes alternate, repeat by repeat, so both see the same moments of a shared machine (_Sleepy's
    # forwards by rows)
    rows: list[int] = []

    class Logged(_Sleepy):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows.append(len(x))
            return super().forward(x)

    pipe = SleepyPipe()
    pipe.net[0] = Logged(0.0, 0.0)
    measure(pipe, (torch.randn(32, 4), torch.randn(32, 4)), repeats=3)
    # the batch's run (its forward through every block), the quarter batch's, the FLOP count, the timed pairs
    assert rows == [32, 8, 32, 32, 8, 32, 8, 32, 8]
    slept, _ = _time_each([lambda: time.sleep(0.002), lambda: None], 3)
    assert slept >= 0.002  # each call's own figure (a sleep lasts at least its time)


def test_on_cuda_every_timed_call_waits_for_the_gpu_before_and_after(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    _time_each([lambda: events.append("a"), lambda: events.append("b")], 2)
    assert events == ["sync", "a", "sync", "sync", "b", "sync"] * 2  # the kernels inside the timed span


def test_block_seconds_and_the_pipelines_micro_batches_by_hand() -> None:
    blocks = tuple(
        Block(f"{i}", 0, 64, 0, 0, forward_s=f, backward_s=b, flops=0.0, forward_fixed_s=ff, backward_fixed_s=bf)
        for i, (f, b, ff, bf) in enumerate([(4.0, 8.0, 1.0, 2.0), (2.0, 4.0, 0.0, 0.0), (1.0, 2.0, 3.0, 0.5)])
    )
    m = Measurement(32, (), 0, blocks, True, "SGD", (), 0, 0.0, 0, "test")
    assert m.block_seconds(0, 8) == (1.0 + 3.0 / 4, 2.0 + 6.0 / 4)  # fixed + the rest x 8/32
    assert m.block_seconds(1, 8) == (0.5, 1.0)  # no fixed part: in proportion
    assert m.block_seconds(2, 8) == (1.0, 0.5 + 1.5 / 4)  # a fixed part above the time: all of it fixed
    # K = 3 stages of one block each, M = 12 micro-batches of K x batch / M = 3 x 32 / 12 = 8 rows
    work = strategy_workload(m, "pipeline", 32, num_stages=3, microbatches=12)
    assert work.stage_seconds == pytest.approx((1.75 + 3.5, 0.5 + 1.0, 1.0 + 0.875))


def test_memory_per_strategy_by_hand() -> None:
    m = measure(Toy(), BATCH)
    p, o, acts = PARAMS, 2 * PARAMS + 24, 32 * 8 * 4 + 4 * 32 * 16 * 4
    ddp = memory("ddp", m, batch=32, world=4)
    assert (ddp.params, ddp.grads, ddp.optimizer, ddp.activations, ddp.buffers) == (p, p, o, acts, p)
    assert memory("ddp", m, batch=64, world=4).activations == 2 * acts  # linear in the batch
    ps = memory("ps", m, batch=32, world=4)
    assert (ps.params, ps.optimizer, ps.buffers) == (p + p / 4, o / 4, p + p / 4)  # the push + the apply's G/S
    assert memory("ps1", m, batch=32, world=4).params == 2 * p
    # tensor, T = 2: the split layers are every weight; 2048 + 2048 saved bytes split in two
    tp = memory("tensor", m, batch=32, world=2, tp_size=2)
    assert tp.params == p / 2 and tp.optimizer == pytest.approx(o / 2)
    assert tp.activations == pytest.approx((acts - 2048) * 2)  # the group's batch is 2 x 32
    # pipeline K=2, M=4 (1F1B): stage 0 holds min(K, M) = 2 micro-batches of 2 x 32 / 4 = 16 rows
    pipe = memory("pipeline", m, batch=32, world=2, stages=2, microbatches=4)
    assert pipe.total == max(pipe.total, memory("pipeline", m, batch=32, world=2, stages=2, microbatches=8).total / 2)
    assert pipe.activations > 0 and pipe.params < p


def test_pipeline_memory_per_stage_by_hand() -> None:
    m = measure(Toy(), BATCH)
    stages = pipeline_memory(m, batch=32, stages=2, microbatches=4)
    # balance by parameters (the strategy's "params"): [net.0, relu] | [net.2, relu, net.4] (144 | 340 weights)
    assert [s.params for s in stages] == [4 * 144, 4 * 340] and sum(s.params for s in stages) == PARAMS
    assert [s.grads for s in stages] == [4 * 144, 4 * 340]
    # stage 0 holds min(K - 0, M) = 2 micro-batches of 2 x 32 / 4 = 16 rows: net.0's input and the ReLU's output;
    # stage 1 one: net.2's input and the ReLU's (16 x 16 each), net.4's input (16 x 16)
    assert [s.activations for s in stages] == [2 * (16 * 8 + 16 * 16) * 4, 1 * 3 * 16 * 16 * 4]
    # a send and a receive buffer of the 16 x 16 boundary activation
    assert [s.buffers for s in stages] == [2 * 16 * 16 * 4] * 2
    assert memory("pipeline", m, batch=32, world=2, stages=2, microbatches=4) == max(stages, key=lambda s: s.total)


def test_advise_ranks_fitting_strategies_by_step_and_marks_the_others() -> None:
    m = measure(Toy(), BATCH)
    fast = Cluster(nodes=2, per_node=2, intra_gbps=100, inter_gbps=1, latency_us=10, device_memory_gib=1)
    advice = advise(m, fast)
    ranks = [r.rank for r in advice.rows if r.rank]
    assert ranks == list(range(1, len(ranks) + 1))
    steps = [r.step_s for r in advice.rows if r.rank]
    assert steps == sorted(steps)
    assert {r.name for r in advice.rows} == {"ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps1", "ps_ring", "async",
                                             "pipeline", "tensor", "ft", "local_sgd", "diloco"}  # fmt: skip
    # local_sgd and diloco fit and have a step time, but a different optimisation: listed, not ranked
    unranked = [r for r in advice.rows if r.name in ("local_sgd", "diloco")]
    assert all(r.fits and r.rank is None and r.reason.startswith("not ranked") for r in unranked)
    assert all(r.reason for r in advice.rows) and advice.best().rank == 1
    # a device smaller than every footprint: nothing ranked, and a message that says so
    tiny = fast.with_(device_memory_gib=1e-9)
    none = advise(m, tiny)
    assert all(r.rank is None and not r.fits for r in none.rows)
    with pytest.raises(NoStrategyFitsError, match=r"no strategy fits this model .* expected at most 1e-09 GiB"):
        none.best()


def test_advised_ps_on_several_nodes_is_the_hierarchical_push() -> None:
    # 4 nodes of 8: ps pushes 1/L of the node's sum across nodes, so its NIC carries the
    # hierarchical ring's 2(N-1)/N x D and a worker sends 2(N-1) = 6 RPC messages, not 2(P-1) = 62
    m = measure(Toy(), BATCH)
    cluster = Cluster(nodes=4, per_node=8, intra_gbps=100, inter_gbps=1, latency_us=10, device_memory_gib=1)
    by = {r.name: r for r in advise(m, cluster).rows}
    assert by["ps"].nic_bytes == pytest.approx(2 * 3 / 4 * PARAMS, rel=1e-12)
    assert by["ps"].nic_bytes == pytest.approx(by["ring_hier"].nic_bytes, rel=1e-12)
    # async's worker is the node (synchronous inside): the same hierarchical traffic (the flat push: 2L(P-L)/P)
    assert by["async"].nic_bytes == pytest.approx(2 * 3 / 4 * PARAMS, rel=1e-12)
    assert by["ps"].reason.startswith("sharded parameter servers: 6 RPC messages per step per worker")


def test_strategy_workload_is_what_each_strategy_steps_by_hand() -> None:
    from lightning_strategies.advisor.advise import model_key, strategy_workload

    m = measure(Toy(), BATCH)
    dp = strategy_workload(m, "ddp", 32)
    assert (dp.grad_bytes, dp.tensors) == (PARAMS, 6)  # 3 weights, 3 biases
    # the pipeline: K = 2 stages, M = 4 micro-batches of 2 x 32 / 4 = 16 samples each
    pipe = strategy_workload(m, "pipeline", 32, num_stages=2, microbatches=4)
    assert (pipe.stages, pipe.microbatches, pipe.schedule) == (2, 4, "1f1b")
    assert pipe.activation_bytes == 16 * 16 * 4  # any cut before the last layer: 16 features, float32
    # tensor: a group of T = 2 steps 2 x 32 samples: the activation payloads scaled by 64 / 32
    tp = strategy_workload(m, "tensor", 32, tp_size=2)
    assert tp.tensor_size == 2
    assert tp.tensor_collectives == pytest.approx(tuple(2 * x for x in m.tensor_payloads))
    assert (model_key("ps1"), model_key("ps"), model_key("pipeline")) == ("ps_1", "ps", "pipeline")


def test_the_advised_overrides_name_the_apps_strategy_configs() -> None:
    advice = advise(measure(Toy(), BATCH), load_cluster("emulated_2x2_50mbit"))
    by = {r.name: r for r in advice.rows}
    assert by["ps1"].overrides() == ["strategy=ps", "strategy.num_servers=1"]
    assert (
        by["pipeline"].overrides()[0] == "strategy=pipeline" and "strategy.num_stages" in by["pipeline"].overrides()[1]
    )
    conf = Path(__file__).resolve().parents[2] / "conf" / "strategy"
    for r in advice.rows:
        assert (conf / f"{r.overrides()[0].split('=')[1]}.yaml").is_file()


def test_a_cpu_message_between_nodes_pays_the_hosts_message_cost_and_the_wire() -> None:
    # gloo on CPU: a message inside a node (386.8 us: software and wake-up, the loopback wire free) plus
    # the wire's half ping (48.6 us); a GPU preset states the whole message (NCCL's proxy included)
    cpu = load_cluster("emulated_4x1_1gbit")
    assert cpu.costs(0.01).inter.latency_s == pytest.approx((386.8 + 48.6) * 1e-6)
    assert cpu.costs(0.01).rpc_inter.latency_s == pytest.approx((386.8 + 48.6) * 1e-6)
    assert cpu.costs(0.01).intra.latency_s == pytest.approx(386.8e-6)
    gpu = load_cluster("a100")
    assert gpu.costs(0.01).inter.latency_s == pytest.approx(gpu.latency_us * 1e-6)


def test_presets_load_with_every_figure_and_bad_input_is_refused(tmp_path: Path) -> None:
    names = preset_names()
    assert {"a100", "h100", "loopback", "emulated_2x2_50mbit", "emulated_4x1_1gbit"} <= set(names)
    for name in names:
        c = load_cluster(name)
        assert c.world >= 2 and c.name == name
    a100 = load_cluster("a100")
    assert (a100.per_node, a100.intra_gbps, a100.inter_gbps, a100.tflops) == (8, 2400, 100, 60.0)
    costs = a100.costs(0.1)
    assert costs.inter.bandwidth == 100e9 / 8 and costs.intra.latency_s == pytest.approx(5e-6) and costs.cores is None
    with pytest.raises(ValueError, match="found no file"):
        load_cluster("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 1\nper_node: 2\nintra_gbps: 1\ninter_gbps: 1\nlatency_us: 1\ndevice_memory_gib: 1\nfoo: 2\n")
    with pytest.raises(ValueError, match=r"found keys \['foo'\]"):
        load_cluster(bad)
    with pytest.raises(ValueError, match="found nodes=0"):
        Cluster(nodes=0, per_node=1, intra_gbps=1, inter_gbps=1, latency_us=1, device_memory_gib=1)
    # the emulated 4 x 1 presets state the flat exchange's share of the link (cluster_exchange.txt), the rest 1
    assert load_cluster("emulated_4x1_50mbit").costs(0.1).all_to_all_share == pytest.approx(0.774)
    assert a100.costs(0.1).all_to_all_share == 1.0
    with pytest.raises(ValueError, match="found all_to_all_share=0"):
        Cluster(nodes=2, per_node=1, intra_gbps=1, inter_gbps=1, latency_us=1, device_memory_gib=1, all_to_all_share=0)
    with pytest.raises(ValueError, match=r"found ring_share=1.5: expected a share of one stream's goodput in \(0, 1\]"):
        Cluster(nodes=2, per_node=1, intra_gbps=1, inter_gbps=1, latency_us=1, device_memory_gib=1, ring_share=1.5)


def test_the_report_json_has_every_strategy_and_key_and_the_png_is_written(tmp_path: Path) -> None:
    advice = advise(measure(Toy(), BATCH), load_cluster("loopback"))
    data = json.loads(json.dumps(to_json(advice)))
    assert data["world"] == 2 and data["measured"]["params"] == PARAMS
    assert len(data["strategies"]) == len(STRATEGIES) == 13
    for row in data["strategies"]:
        assert set(row) == set(JSON_KEYS)
        assert row["step_s"] is None or math.isfinite(row["step_s"])
        assert row["memory_total"] == pytest.approx(sum(row["memory"].values()))
    png = write_png(advice, tmp_path / "a.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
