"""Hierarchical ``"async"`` (the node is the asynchronous worker) under two torchrun "nodes" of 2 processes each.

``torchrun --nnodes 2 --nproc-per-node 2`` twice on 127.0.0.1 (static rendezvous; ``_torchrun_utils``), each
worker running ``_async_hier_torchrun.py``'s five fits. Checked:

- the choice and the layout: hierarchical with nodes ``[[0, 1], [2, 3]]`` (Lightning's
  ``TorchElasticEnvironment``), flat when asked; the node's processes train on the same weights at every step;
- under the bulk-synchronous schedule (``max_staleness=0``) the weights' change over 2 epochs equals
  hierarchical ``"ps"``'s and flat ``"async"``'s: in all three every sample's gradient enters once per epoch
  with the same step per sample (the node's push is the mean over its 2 batches, at lr 0.02; ps averages 4
  batches and takes one step at 0.04 for the 2 nodes' pushes; flat async pushes each batch alone at 0.01),
  so they agree to first order in the lr and differ only in the weights each gradient is taken at (measured
  0.3% of the change); ``rtol=0.02`` holds that, and a node sum missing a process, or not weighted by its
  share, changes the weights by 50% or more;
- the staleness bound between nodes: the coordinator sees 2 workers (the nodes), their clocks within one
  step, and no node step admitted before every other node pushed the previous one;
- every sample trained once per epoch (also with a short last unit, split 2 + 2 samples, weights 1/2 each);
- the bytes a node's NIC carries, from the clients' counts: each process sends its chunk's remote shard once
  per node step and hears back as much, :func:`~lightning_strategies.comm.ps.hierarchy.node_nic_bytes`.

One launch serves the tests (a module fixture): about 40-90 s on 2 loaded cores.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from _torchrun_utils import assert_node_push_bytes, run_torchrun_nodes
from lightning_utils import TinyRegressor

pytestmark = pytest.mark.slow

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
SCRIPT = Path(__file__).with_name("_async_hier_torchrun.py")
HIER = ("async_hier_bsp", "async_hier_free", "async_hier_tail")
SAMPLES = {"async_hier_bsp": 96, "async_hier_free": 96, "async_hier_tail": 100}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("async_hier")
    run_torchrun_nodes(["--out-dir", str(out)], nnodes=NODES, nproc_per_node=LOCAL, log_dir=out, script=SCRIPT,
                       timeout=600)  # fmt: skip
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _delta(out: Path, name: str) -> torch.Tensor:
    start = TinyRegressor().state_dict()
    weights = torch.load(out / f"{name}_rank0.pt", weights_only=False)
    return torch.cat([(weights[k] - start[k]).flatten() for k in start])


def test_the_node_is_the_worker_and_its_processes_train_on_the_same_weights(run: tuple[Path, list[dict]]) -> None:
    records = run[1]
    for record in records:
        for name in HIER:
            assert record[name]["hierarchical"] is True, (name, record[name])
            assert record[name]["client"] == "HierarchicalAsyncClient"
            assert record[name]["nodes"] == [[0, 1], [2, 3]]
        assert record["async_flat_bsp"]["hierarchical"] is False
        assert record["async_flat_bsp"]["client"] == "AsyncParameterServerClient"
    for name in HIER:
        for a, b in ((0, 1), (2, 3)):
            # the same steps on the same weights (checksums) in both processes of a node, also after held pulls
            steps_a, steps_b = records[a][name]["steps"], records[b][name]["steps"]
            assert [s[3] for s in steps_a] == [s[3] for s in steps_b], (name, a, b)
            assert [s[0] for s in steps_a] == [s[0] for s in steps_b]
        # leases on the nodes' leaders only
        assert [records[r][name]["lease_admissions"] is not None for r in range(WORLD)] == [True, False, True, False]


def test_bulk_synchronous_hierarchical_async_trains_like_ps_and_flat_async(run: tuple[Path, list[dict]]) -> None:
    hier = _delta(run[0], "async_hier_bsp")
    assert float(hier.norm()) > 0.1  # it trained
    for other in ("ps_hier", "async_flat_bsp"):
        # first order in the lr (the module docstring): 0.3% measured, a wrong node sum >= 50%
        assert float((_delta(run[0], other) - hier).norm() / hier.norm()) < 0.02, other


def test_the_staleness_bound_holds_between_nodes(run: tuple[Path, list[dict]]) -> None:
    record = run[1][0]["async_hier_bsp"]
    clock_log = record["clock_log"]
    assert len(clock_log) >= 10 and all(len(row) == NODES for row in clock_log)  # one clock per node
    rows = [[c for c in row if c >= 0] for row in clock_log]
    assert max(max(row) - min(row) for row in rows if row) <= 1
    admissions = record["admissions"]
    assert {worker for worker, _, _ in admissions} == {0, 1}
    assert max(clock - low for _, clock, low in admissions) <= 0
    for leader in (0, 2):  # every node step of both leaders: its clock never ahead of the other node's
        gaps = [c - low for c, low in run[1][leader]["async_hier_bsp"]["lease_admissions"]]
        assert gaps and max(gaps) <= 0, (leader, gaps)


@pytest.mark.parametrize("name", HIER)
def test_every_sample_is_trained_once_per_epoch(run: tuple[Path, list[dict]], name: str) -> None:
    records = run[1]
    for epoch in range(2):
        trained: Counter[int] = Counter()
        for node in ((0, 1), (2, 3)):
            steps = [[s for s in records[r][name]["steps"] if s[0] == epoch] for r in node]
            assert len(steps[0]) == len(steps[1])  # the node's processes step together
            for parts in zip(*steps, strict=True):
                total = sum(len(p[1]) for p in parts)
                for p in parts:
                    assert p[2] == pytest.approx(len(p[1]) / total)  # its share of the node step
                    trained.update(p[1])
        assert trained == Counter(range(SAMPLES[name])), (name, epoch)
    if name == "async_hier_tail":  # the last unit holds one batch of 4: split 2 + 2
        sizes = sorted(len(s[1]) for r in range(WORLD) for s in records[r][name]["steps"])
        assert sizes.count(2) == 2 * 2 and set(sizes) == {2, 4}


@pytest.mark.parametrize("name", ["async_hier_free", "async_hier_tail"])
def test_node_bytes_equal_the_formula(run: tuple[Path, list[dict]], name: str) -> None:
    records = [r[name] for r in run[1]]
    assert_node_push_bytes(records, NODES, LOCAL)
