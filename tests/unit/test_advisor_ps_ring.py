"""The advisor's ``ps_ring``: the ring's exchange (hierarchical on several nodes of several processes, as the
strategy), the optimizer on 1/P, its buffers, and no advice for an optimizer its shards cannot step."""

from __future__ import annotations

import dataclasses

import pytest
from test_advisor import BATCH, PARAMS, Toy

from lightning_strategies.advisor import Cluster, advise, measure
from lightning_strategies.advisor.advise import strategy_workload
from lightning_strategies.advisor.memory import memory
from lightning_strategies.advisor.model import predict


def test_ps_ring_is_the_rings_exchange_with_the_optimizer_on_one_pth() -> None:
    m = measure(Toy(), BATCH)
    work = strategy_workload(m, "ps_ring", 32, world=4)
    assert work.optimizer_s == pytest.approx(m.optimizer_s / 4) and m.optimizer_s > 0
    assert strategy_workload(m, "ring", 32, world=4).optimizer_s == m.optimizer_s  # a ring rank steps all of it
    for nodes, per_node, same_as in ((2, 2, "ring_hier"), (1, 4, "ring"), (4, 1, "ring")):
        cluster = Cluster(nodes=nodes, per_node=per_node, intra_gbps=100, inter_gbps=1, latency_us=10,
                          device_memory_gib=1)  # fmt: skip
        costs = cluster.costs(m.step_s)
        # the same workload: the same prediction as the ring it runs on, phase by phase
        assert predict("ps_ring", costs, 4, work) == predict(same_as, costs, 4, work), (nodes, per_node)
        # its own workload: the loop's optimizer step is a quarter of the ring's
        ring = predict(same_as, costs, 4, strategy_workload(m, same_as, 32, world=4))
        assert predict("ps_ring", costs, 4, work).phases["loop"] < ring.phases["loop"]


def test_ps_ring_memory_by_hand() -> None:
    m = measure(Toy(), BATCH)  # Adam: exp_avg, exp_avg_sq and a step per tensor
    o, acts = 2 * PARAMS + 24, 32 * 8 * 4 + 4 * 32 * 16 * 4
    got = memory("ps_ring", m, batch=32, world=4)
    # the model, its gradients, a quarter of the optimizer state; every bucket's gradients and values
    assert (got.params, got.grads, got.optimizer, got.activations, got.buffers) == (
        PARAMS,
        PARAMS,
        o / 4,
        acts,
        2 * PARAMS,
    )


def test_ps_ring_is_advised_only_for_an_elementwise_optimizer() -> None:
    m = measure(Toy(), BATCH)
    cluster = Cluster(nodes=2, per_node=2, intra_gbps=100, inter_gbps=1, latency_us=10, device_memory_gib=1)
    row = {r.name: r for r in advise(m, cluster).rows}["ps_ring"]
    assert row.fits and row.rank is not None and row.overrides() == ["strategy=ps_ring"]
    assert row.reason.startswith("sharded servers on the ring's reduce-scatter and all-gather")
    lamb = dataclasses.replace(m, optimizer="Lamb")
    row = {r.name: r for r in advise(lamb, cluster).rows}["ps_ring"]
    assert not row.fits and row.rank is None
    assert row.reason == "Lamb is not an elementwise optimizer: a chunk of the ring cuts tensors anywhere (use ps)"
