"""Tensor-parallel plans, their errors and the activation-byte formula (comm/tensor.py, one process
except the last test)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn
from torchvision.models import resnet18

from lightning_strategies import TensorParallelStrategy
from lightning_strategies.comm.tensor import (
    activation_bytes_per_step,
    auto_plan,
    check_plan,
    ring_all_reduce_bytes,
)


def mlp(width: int = 32, layers: int = 4) -> nn.Sequential:
    mods: list[nn.Module] = [nn.Flatten(), nn.Linear(64, width)]
    for _ in range(layers - 2):
        mods += [nn.ReLU(), nn.Linear(width, width)]
    mods += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 10)]
    return nn.Sequential(*mods)


def test_auto_plan_pairs_consecutive_linears_of_a_sequential() -> None:
    assert auto_plan(mlp(layers=4)) == {"1": "colwise", "3": "rowwise", "5": "colwise", "8": "rowwise"}
    # an odd count: the last one alone is column-parallel with its output gathered
    assert auto_plan(mlp(layers=3)) == {"1": "colwise", "3": "rowwise", "6": "colwise_gather"}


def test_auto_plan_of_a_resnet_splits_its_classifier() -> None:
    assert auto_plan(resnet18(num_classes=10)) == {"fc": "colwise_gather"}


def test_a_non_elementwise_module_breaks_a_pair() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    assert auto_plan(net) == {"0": "colwise_gather", "2": "colwise_gather"}


@pytest.mark.parametrize(
    ("plan", "tp", "message"),
    [
        ({"1": "colwise", "3": "rowwise", "5": "colwise", "8": "rowwise"}, 3,
         r"layer '1' \(Linear 64 -> 32, colwise\) has out_features=32, not divisible by tp_size=3.*Fix: make "
         r"out_features a multiple of 3, pass a tp_size dividing 32, or leave '1' out of plan"),
        ({"8": "colwise_gather"}, 4, r"layer '8' .* out_features=10, not divisible by tp_size=4"),
        ({"3": "rowwise", "1": "colwise", "5": "rowwise"}, 2, r"found 1 'colwise' and 2 'rowwise' layers: expected"),
        ({"2": "colwise"}, 2, r"found a ReLU at '2': expected an nn.Linear"),
        ({"head": "colwise"}, 2, r"found no such module at 'head'"),
        ({"1": "diagonal"}, 2, r"style 'diagonal': expected one of 'colwise', 'rowwise', 'colwise_gather'"),
        ({}, 2, r"empty plan"),
    ],
    ids=["width", "gather-width", "unpaired", "not-linear", "missing", "style", "empty"],
)
def test_bad_plans_say_what_and_how_to_fix(plan: dict[str, str], tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_plan(mlp(), plan, tp)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, r"tp_size=0\): expected a positive integer"),
        ({"tp_size": True}, r"tp_size=True\): expected a positive integer"),
        ({"plan": {"fc": "sideways"}}, r"found the style\(s\) \{'fc': 'sideways'\}"),
        ({"plan": ["fc"]}, r"expected None or a mapping"),
    ],
)
def test_strategy_checks_its_options_when_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorParallelStrategy(**kwargs)


def test_sampler_and_replicas_follow_tp_size() -> None:
    from lightning_strategies import replicas_of

    def four_processes(strategy: TensorParallelStrategy, rank: int) -> TensorParallelStrategy:
        # as the Trainer sets them: 4 devices, this process the rank-th
        env = LightningEnvironment()
        env.set_world_size(4)
        env.set_global_rank(rank)
        strategy.cluster_environment = env
        return strategy

    strategy = four_processes(TensorParallelStrategy(tp_size=2), 3)
    assert strategy.replicas == 2 and replicas_of(strategy) == 2  # what the app's scaling rule sees
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert four_processes(TensorParallelStrategy(), 3).replicas == 1  # tp_size = the world


def test_ring_bytes_formula() -> None:
    assert ring_all_reduce_bytes(1000, 1) == 0
    assert ring_all_reduce_bytes(1000, 2) == 1000  # 2 (n-1)/n x payload
    assert ring_all_reduce_bytes(1000, 4) == 1500


def test_activation_bytes_formula_by_hand() -> None:
    net = mlp(width=32, layers=4)
    plan = auto_plan(net)
    # per pair: forward all-reduce of the row output + backward all-reduce of the column input, rows=5
    # pair 1: in 64, out 32; pair 2: in 32, out 10; tp=2 -> ring sends the payload once
    expected = 5 * 4 * (64 + 32) + 5 * 4 * (32 + 10)
    assert activation_bytes_per_step(net, plan, rows=5, tp_size=2) == expected


@pytest.mark.slow
def test_counted_bytes_match_the_formula() -> None:
    """Two processes: the collectives the split module runs, counted, against the formula."""
    from dist_utils import run_workers

    results = run_workers(_count_bytes, 2, timeout=60)
    net = mlp(width=32, layers=3)
    formula = activation_bytes_per_step(net, auto_plan(net), rows=6, tp_size=2)
    for r in results:
        # the first layer's input (data) needs no gradient: its backward all-reduce is skipped
        assert r["sent"] == formula - ring_all_reduce_bytes(6 * 64 * 4, 2)
        assert r["calls"] == {"forward": 2, "backward": 1}  # row all-reduce + gather; the gather's input


def _count_bytes(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_strategies.comm.tensor import parallelize

    torch.manual_seed(0)
    net = mlp(width=32, layers=3)
    tp = parallelize(net, init_device_mesh("cpu", (world,)), auto_plan(net))
    net(torch.randn(6, 1, 8, 8)).sum().backward()
    return {
        "sent": tp.stats.total().bytes_sent,
        "calls": {"forward": tp.stats.forward.calls, "backward": tp.stats.backward.calls},
    }
