"""The node as the asynchronous worker: its plan of units, a process's part of a unit, the options refused.

The multi-process behaviour (2 x 2 under torchrun) is ``tests/integration/test_async_hierarchical_torchrun.py``.
"""

from __future__ import annotations

import pytest

from lightning_strategies import AsyncElasticStrategy, AsyncParameterServerStrategy
from lightning_strategies.comm.async_ import DataPlan
from lightning_strategies.comm.async_hierarchy import NodePlan, node_part


@pytest.mark.parametrize(("samples", "drop_last"), [(96, False), (100, False), (100, True), (7, False)])
@pytest.mark.parametrize("unit", [1, 2, 3])
def test_units_are_the_base_plans_batches_in_order(samples: int, drop_last: bool, unit: int) -> None:
    base = DataPlan(samples, 4, drop_last, shuffle=True, seed=3)
    plan = NodePlan(samples, 4, drop_last, True, 3, unit=unit)
    assert plan.base == base
    batches = base.batches(5)
    units = plan.batches(5)
    assert plan.num_batches == len(units) == -(-base.num_batches // unit)
    # each unit: `unit` consecutive batches of the loader's plan, so an epoch's units cover its batches once
    assert units == [[i for b in batches[u : u + unit] for i in b] for u in range(0, len(batches), unit)]


def test_a_full_unit_gives_each_process_one_batch_of_weight_one_over_its_size() -> None:
    unit = list(range(100, 112))  # 3 batches of 4
    parts = [node_part(unit, 3, j) for j in range(3)]
    assert [p for p, _ in parts] == [unit[0:4], unit[4:8], unit[8:12]]
    assert [w for _, w in parts] == [pytest.approx(1 / 3)] * 3


def test_a_short_unit_is_split_evenly_and_weighted_by_samples() -> None:
    parts = [node_part([1, 2, 3, 4, 5], 2, j) for j in range(2)]
    assert parts == [([1, 2, 3], 0.6), ([4, 5], 0.4)]
    # fewer samples than processes: the others train the first sample with weight 0 (for the node's collective)
    parts = [node_part([7, 8], 4, j) for j in range(4)]
    assert parts == [([7], 0.5), ([8], 0.5), ([7], 0.0), ([7], 0.0)]
    assert sum(w for _, w in parts) == 1.0


@pytest.mark.parametrize(("indices", "part"), [([], 0), ([1], 2), ([1], -1)])
def test_node_part_refuses_an_empty_unit_or_a_part_out_of_range(indices: list[int], part: int) -> None:
    with pytest.raises(ValueError, match="node_part"):
        node_part(indices, 2, part)


def test_node_plan_refuses_a_unit_below_one() -> None:
    with pytest.raises(ValueError, match="unit=0"):
        NodePlan(8, 4, unit=0)


@pytest.mark.parametrize("option", [{"push_every": 2}, {"pull_every": 3}])
def test_hierarchical_async_refuses_exchanges_less_often_than_every_step(option: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"push_every=1 and pull_every=1.*hierarchical=False"):
        AsyncParameterServerStrategy(hierarchical=True, **option)  # type: ignore[arg-type]
    AsyncParameterServerStrategy(hierarchical=None, **option)  # type: ignore[arg-type]  # flat on several nodes


def test_async_elastic_refuses_the_node_as_worker() -> None:
    with pytest.raises(ValueError, match=r"AsyncElasticStrategy\(hierarchical=True\).*one process at a time"):
        AsyncElasticStrategy(hierarchical=True)
    assert AsyncElasticStrategy(hierarchical=None).hierarchical_push is False
