"""The advisor's training-loop phase: the optimizer step timed by ``measure``, each process's share of it, the
loop's host work per step (``Cluster.loop_us``), every strategy paying both under the processes' contention."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

from lightning_strategies.advisor import Cluster, load_cluster, measure
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.costs import Costs, Link, Workload
from lightning_strategies.advisor.ft_model import FT_STRATEGIES, predict_ft
from lightning_strategies.advisor.memory import pipeline_stages
from lightning_strategies.advisor.model import STRATEGIES, predict
from tests.unit.test_advisor import BATCH, Toy

SLEEP_S = 0.004


class _SlowSGD(torch.optim.SGD):
    """SGD whose every step also sleeps ``SLEEP_S``: a step of known length."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(SLEEP_S)
        return super().step(closure)


class SlowToy(Toy):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _SlowSGD(self.parameters(), lr=0.1, momentum=0.9)


def test_measure_times_the_optimizer_step_and_leaves_the_weights() -> None:
    module = SlowToy("sgd")
    before = [p.detach().clone() for p in module.parameters()]
    m = measure(module, BATCH, repeats=3)
    # the sleep plus SGD's arithmetic on 484 weights (microseconds)
    assert SLEEP_S <= m.optimizer_s < SLEEP_S + 0.05
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))
    assert measure(Toy(), BATCH).optimizer_s < SLEEP_S  # no sleep: SGD alone on 484 weights
    # a stated throughput times nothing here: the optimizer's step is not charged from FLOPs
    assert measure(SlowToy("sgd"), BATCH, tflops=1.0).optimizer_s == 0.0


def _costs(loop_s: float) -> Costs:
    link = Link(1e-4, 1e9)
    return Costs(compute_s=0.01, local_size=2, intra=link, inter=link, cores=2.0, loop_s=loop_s,
                 rpc_intra=link, rpc_inter=link)  # fmt: skip


def test_every_strategy_pays_the_loop_and_its_optimizer_step_under_contention() -> None:
    work = Workload(grad_bytes=4e6, tensors=4, stages=2, microbatches=4, tensor_size=2, optimizer_s=2e-4)
    bare = dataclasses.replace(work, optimizer_s=0.0)
    k = 4 / 2.0  # 4 processes on 2 cores
    for s in STRATEGIES:
        got, before = predict(s, _costs(1e-3), 4, work), predict(s, _costs(0.0), 4, bare)
        assert "loop" not in before.phases
        assert got.phases["loop"] == pytest.approx(k * (1e-3 + 2e-4)), s
        assert got.step_s == pytest.approx(before.step_s + k * 1.2e-3), s
        assert got.step_s == pytest.approx(sum(got.phases.values())), s
    for s in FT_STRATEGIES:
        got = predict_ft(s, _costs(1e-3), 4, work, sync_every=4)
        before = predict_ft(s, _costs(0.0), 4, bare, sync_every=4)
        assert got.step_s == pytest.approx(before.step_s + k * 1.2e-3), s
    # one process per core: no contention, the loop alone
    assert predict("ddp", _costs(1e-3), 1, work).phases["loop"] == pytest.approx(1.2e-3)


def test_each_process_steps_its_own_share_of_the_optimizer() -> None:
    m = dataclasses.replace(measure(Toy(), BATCH), optimizer_s=1.0)  # a step of 1 s over the whole model
    for s in ("ddp", "ring", "ring_hier", "ring_bf16", "ft", "local_sgd", "diloco"):
        assert strategy_workload(m, s, 32).optimizer_s == 1.0, s
    for s in ("ps", "ps1", "async"):  # the shards step (the model's ps host work), not the workers
        assert strategy_workload(m, s, 32).optimizer_s == 0.0, s
    # a pipeline stage steps its own blocks: the largest stage's share of the parameters
    stages = pipeline_stages(m, 2)
    per_stage = [sum(m.blocks[i].param_bytes for i in s) for s in stages]
    got = strategy_workload(m, "pipeline", 32, num_stages=2, microbatches=4).optimizer_s
    assert got == pytest.approx(max(per_stage) / m.param_bytes) and got < 1.0
    # a tensor rank: its 1/T of the split layers and every whole tensor
    whole = m.tensor_replicated_bytes
    got = strategy_workload(m, "tensor", 32, tp_size=2).optimizer_s
    assert got == pytest.approx((whole + (m.param_bytes - whole) / 2) / m.param_bytes) and got < 1.0


def test_the_loop_is_a_presets_figure_and_a_negative_one_is_refused() -> None:
    assert load_cluster("emulated_2x2_1gbit").costs(0.1).loop_s == pytest.approx(754.1e-6)
    assert load_cluster("loopback").loop_us == pytest.approx(754.1)
    assert load_cluster("a100").costs(0.1).loop_s == 0.0  # not measured on a GPU host: not charged
    with pytest.raises(ValueError, match=r"found loop_us=-1: expected >= 0"):
        Cluster(nodes=1, per_node=1, intra_gbps=1, inter_gbps=1, latency_us=1, device_memory_gib=1, loop_us=-1)


def test_the_validation_slows_the_loop_and_the_optimizer_with_the_cpu() -> None:
    from benchmarks._scale_costs import slower
    from benchmarks.advisor_validation import at_speed

    assert slower(_costs(1e-3), 3.0).loop_s == pytest.approx(3e-3)
    m = dataclasses.replace(measure(Toy(), BATCH), optimizer_s=2e-4)
    assert at_speed(m, 3.0).optimizer_s == pytest.approx(6e-4)


def test_the_reason_does_not_count_the_loop_as_communication() -> None:
    from lightning_strategies.advisor.advise import _reason
    from lightning_strategies.advisor.costs import Prediction

    pred = Prediction(1.0, {"compute": 0.5, "loop": 0.25, "bandwidth": 0.25}, 0.0, 2e6, 0.0, 2.0)
    cluster = load_cluster("loopback")
    assert "communication 25% of the step" in _reason("ddp", pred, None, cluster, {})  # type: ignore[arg-type]
