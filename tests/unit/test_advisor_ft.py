"""The advisor's torchft strategies (``advisor.ft_model``, ``advisor.memory``): step formulas against
hand-computed values, memory against what ``comm.ft``'s outer loop and flat copy really hold."""

from __future__ import annotations

import pytest
import torch
from test_advisor import BATCH, PARAMS, Toy

from lightning_strategies.advisor import measure, memory
from lightning_strategies.advisor.costs import Costs, Link, Workload
from lightning_strategies.advisor.ft_model import predict_ft
from lightning_strategies.comm.ft import OuterLoop, flatten

MIB = 1 << 20
# 2 nodes of 1: 1 ms and 10 MB/s between them, 1 MiB segments, adding 0.1 ns per byte, 5 ms per sync's protocol
COSTS = Costs(compute_s=0.1, local_size=1, intra=Link(1e-4, 1e8), inter=Link(1e-3, 1e7),
              reduce_s_per_byte=1e-10, ft_protocol_s=0.005)  # fmt: skip
D = 4 * MIB


def test_ft_is_compute_then_the_quorum_then_a_flat_ring_of_the_whole_gradient() -> None:
    pred = predict_ft("ft", COSTS, 2, Workload(grad_bytes=D))
    # one ring all-reduce of D over P = 2 across the nodes: 2(P-1) = 2 steps of D/P = 2 MiB, 2 segments each
    latency = 2 * 2 * 1e-3
    bandwidth = 2 * (2 * MIB) / 1e7
    reduce = 2 * MIB * 1e-10
    assert pred.phases == pytest.approx(
        {"compute": 0.1, "protocol": 0.005, "latency": latency, "bandwidth": bandwidth, "reduce": reduce}
    )
    assert pred.step_s == pytest.approx(0.1 + 0.005 + latency + bandwidth + reduce)  # 0.52864 s: no overlap
    assert (pred.busiest_sent_bytes, pred.nic_bytes, pred.messages) == (D, D, 4)  # 2(P-1)/P x D, all across


@pytest.mark.parametrize("strategy", ["local_sgd", "diloco"])
def test_local_sgd_and_diloco_pay_one_sync_every_h_steps(strategy: str) -> None:
    ft = predict_ft("ft", COSTS, 2, Workload(grad_bytes=D))
    pred = predict_ft(strategy, COSTS, 2, Workload(grad_bytes=D), sync_every=10)
    sync = ft.step_s - 0.1  # the protocol and the all-reduce of D, now once per 10 steps
    assert pred.step_s == pytest.approx(0.1 + sync / 10)
    assert pred.busiest_sent_bytes == pytest.approx(D / 10) and pred.messages == pytest.approx(0.4)
    # one replica: nothing to sync
    alone = predict_ft(strategy, COSTS, 1, Workload(grad_bytes=D), sync_every=10)
    assert alone.step_s == pytest.approx(0.1) and alone.busiest_sent_bytes == 0


def test_bad_input_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="found strategy 'ddp'"):
        predict_ft("ddp", COSTS, 2, Workload(grad_bytes=D))
    with pytest.raises(ValueError, match="sync_every=0"):
        predict_ft("diloco", COSTS, 2, Workload(grad_bytes=D), sync_every=0)


def test_ft_memory_adds_the_flat_copy_it_all_reduces() -> None:
    m = measure(Toy(), BATCH)
    ddp, ft = memory("ddp", m, batch=32, world=2), memory("ft", m, batch=32, world=2)
    grads = [torch.zeros_like(p) for p in Toy().parameters()]
    flat = flatten(grads, None)  # what average_and_commit all-reduces
    assert ft.buffers == flat.numel() * flat.element_size() == PARAMS
    assert (ft.params, ft.grads, ft.optimizer) == (ddp.params, ddp.grads, ddp.optimizer)
    assert ft.activations == ddp.activations


@pytest.mark.parametrize(("algorithm", "momentum"), [("local_sgd", 0.9), ("diloco", 0.9), ("diloco", 0.0)])
def test_outer_loop_memory_is_what_the_outer_loop_holds(algorithm: str, momentum: float) -> None:
    model = Toy()
    m = measure(model, BATCH)
    params = list(model.parameters())
    outer = OuterLoop(params, algorithm=algorithm, sync_every=2, outer_momentum=momentum)
    pending = flatten(outer.tensors(0), None)  # the sync's flat copy
    outer.apply(0, pending.clone())  # materialises the outer optimizer's momentum
    held = sum(b.numel() * b.element_size() for b in outer.backup)
    state = sum(
        t.numel() * t.element_size() for opt in outer.outer for s in opt.state.values() for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )  # fmt: skip
    got = memory(algorithm, m, batch=32, world=2, outer_momentum=momentum)
    base = memory("ddp", m, batch=32, world=2)
    assert got.params - base.params == held == PARAMS  # the global copy
    assert got.optimizer - base.optimizer == state  # DiLoCo's momentum buffer (none without momentum / LocalSGD)
    # the outer gradient (mean.clone() per tensor, during the outer step): DiLoCo only
    assert got.grads - base.grads == (PARAMS if algorithm == "diloco" else 0)
    assert got.buffers == pending.numel() * pending.element_size() == PARAMS
