"""The hierarchical parameter-server push under two torchrun "nodes" of 2 processes each, on 127.0.0.1.

``torchrun --nnodes 2 --nproc-per-node 2`` twice (static rendezvous; ``_torchrun_utils``), each worker
running ``_ps_hier_torchrun.py``: seven fits, ``ParameterServerStrategy()`` (hierarchical, chosen from
Lightning's ``TorchElasticEnvironment`` on 2 nodes, and overlapped with backward in 3 buckets), the same
with ``overlap=False`` and ``hierarchical=False``, with SGD-momentum (the elementwise plan) and Lamb (the
whole-tensor plan), and SGD-momentum accumulating 2 micro-batches, overlapped and not. Checked:

- the choice and the layout: hierarchical with nodes ``[[0, 1], [2, 3]]``, flat when asked;
- the overlapped hierarchical push equals the one-shot one bit for bit (weights and optimizer state, also
  accumulating): per element both divide by 4, sum the node's two quarters (order-free for two terms) and
  the shard sums the two node sums in node order; only the buffers' lengths differ;
- the overlap happens (the clients' timestamps): every step's first in-node reduce-scatter and first
  push leave before backward ends, with push bytes before it; the next forward starts before the step's
  last bucket lands (except after an epoch's last step, whose values land in its optimizer step);
  accumulating, one push of every slice per optimizer step;
- the hierarchical weights, and the optimizer state gathered from its shards, equal the flat push's:
  both divide every gradient by 4 first; the flat shard sums the four quarters in rank order, the
  hierarchical one sums the two node sums, so the float32 sums differ by about an ulp of the gradient
  per step (measured: 3e-8 after 6 steps); ``atol=1e-6`` holds that and fails a wrong layout (a node's
  sum missing, or divided again by the 2 pushers), which moves the weights by > 1e-3. The SGD run equals
  DDP on 4 fork-started processes to the same bound;
- the bytes a node's NIC carries, from the clients' counts (loopback has no NIC to read; the emulated
  cluster's counters are ``benchmarks/cluster_strategies.py``'s ``..._over_formula`` lines): each
  process's ``comm/inter_node_bytes_sent`` is the bytes of its chunk's shard on the other node, its
  node's processes together send ``B - B_n`` of pushes, and with the ``(N-1) B_n`` its shards answer
  the node's NIC carries :func:`~lightning_strategies.comm.ps.hierarchy.node_nic_bytes` (``B``: all
  shards' payload bytes, ``B_n``: node ``n``'s); the flat push's formula gives ``L = 2`` times as much.

One launch serves the tests (a module fixture): two torchrun agents, four workers, seven fits: 100-150 s
on 2 loaded cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _torchrun_fit import fit
from _torchrun_utils import assert_node_push_bytes, run_torchrun_nodes
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor

pytestmark = pytest.mark.slow

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
SCRIPT = Path(__file__).with_name("_ps_hier_torchrun.py")
FITS = (
    "sgd_momentum_hier", "sgd_momentum_hier_serial", "sgd_momentum_flat", "lamb_hier", "lamb_flat",
    "sgd_momentum_hier_accum", "sgd_momentum_hier_serial_accum",
)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("ps_hier")
    run_torchrun_nodes(["--out-dir", str(out)], nnodes=NODES, nproc_per_node=LOCAL, log_dir=out, script=SCRIPT,
                       timeout=600)  # fmt: skip
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_push_is_hierarchical_on_the_launchers_nodes(run: tuple[Path, list[dict]]) -> None:
    for record in run[1]:
        for name in FITS:
            fit_record = record[name]
            hier = "_hier" in name
            assert fit_record["hierarchical"] is hier, (name, fit_record)
            assert fit_record["client"] == ("HierarchicalParameterServerClient" if hier else "ParameterServerClient")
            if hier:
                assert fit_record["nodes"] == [[0, 1], [2, 3]], fit_record


@pytest.mark.parametrize("fit_name", ["sgd_momentum_hier", "sgd_momentum_hier_accum"])
def test_overlapped_hierarchical_push_equals_the_one_shot_push(run: tuple[Path, list[dict]], fit_name: str) -> None:
    overlapped = torch.load(run[0] / f"{fit_name}.pt", weights_only=False)
    one_shot = torch.load(run[0] / f"{fit_name.replace('_hier', '_hier_serial')}.pt", weights_only=False)
    for record in run[1]:
        assert record[fit_name]["push"] == "HierarchicalOverlappedPush", record[fit_name]
        assert "push" not in record[fit_name.replace("_hier", "_hier_serial")]
    # the same sums of the same quarters, element by element (the module docstring): bit for bit
    for k in one_shot["weights"]:
        torch.testing.assert_close(overlapped["weights"][k], one_shot["weights"][k], rtol=0, atol=0,
                                   msg=lambda m, k=k: f"{k}: {m}")  # fmt: skip
    torch.testing.assert_close(overlapped["optimizer"]["state"], one_shot["optimizer"]["state"], rtol=0, atol=0)
    start = TinyRegressor().state_dict()
    assert max(float((overlapped["weights"][k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained


def test_hierarchical_pushes_overlap_backward_and_the_all_gather_the_next_forward(
    run: tuple[Path, list[dict]],
) -> None:
    for rank, record in enumerate(run[1]):
        fit_record = record["sgd_momentum_hier"]
        assert len(fit_record["buckets"]) == 3, fit_record["buckets"]
        steps = fit_record["timeline"]
        assert len(steps) == fit_record["global_step"] == 6, steps
        for t in steps:
            # the first bucket was reduced in the node, and pushed across, while backward still ran
            assert t["first_node_reduce"] < t["backward_end"], (rank, t)
            assert t["first_push"] < t["backward_end"], (rank, t)
            assert 0 < t["bytes_before_backward_end"] <= t["bytes_pushed"], (rank, t)
            assert len(t["pull_landed"]) == 3, (rank, t)  # one all-gather per bucket
        per_epoch = fit_record["batches_per_epoch"]
        for i, t in enumerate(steps[:-1]):  # the last step's values land at the fit's end: no next forward
            if (i + 1) % per_epoch == 0:  # an epoch's last step lands its values in the optimizer step
                assert t["next_forward"] is None, (rank, i, t)
                continue
            # the first layer's buckets were all-gathered and written in while the last layer's was not yet
            assert t["next_forward"] is not None and t["next_forward"] < t["pull_landed"][-1], (rank, i, t)
        # accumulating 2 micro-batches: one push of every slice per optimizer step, none in between
        accum = record["sgd_momentum_hier_accum"]
        assert accum["global_step"] == len(accum["timeline"]) == 3, accum
        assert [t["bytes_pushed"] for t in accum["timeline"]] == [steps[0]["bytes_pushed"]] * 3, (rank, accum)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "lamb"])
def test_hierarchical_weights_and_state_equal_the_flat_push(run: tuple[Path, list[dict]], optimizer: str) -> None:
    hier = torch.load(run[0] / f"{optimizer}_hier.pt", weights_only=False)
    flat = torch.load(run[0] / f"{optimizer}_flat.pt", weights_only=False)
    for k in flat["weights"]:
        torch.testing.assert_close(hier["weights"][k], flat["weights"][k], rtol=0, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")  # fmt: skip
    start = TinyRegressor().state_dict()
    assert max(float((hier["weights"][k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained
    # the optimizer state gathered from the shards (momentum buffers; Lamb's moments and step): the same
    # state, to the same bound (moments of gradients that differ by an ulp)
    assert hier["optimizer"]["state"].keys() == flat["optimizer"]["state"].keys() and flat["optimizer"]["state"]
    torch.testing.assert_close(hier["optimizer"]["state"], flat["optimizer"]["state"], rtol=0, atol=1e-6)


def test_hierarchical_weights_equal_ddp(run: tuple[Path, list[dict]]) -> None:
    hier = torch.load(run[0] / "sgd_momentum_hier.pt", weights_only=False)["weights"]
    want = fit("ring", DDPStrategy(start_method="fork"), devices=WORLD, max_steps=6)
    for k in want:
        torch.testing.assert_close(hier[k], want[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "lamb"])
def test_node_bytes_equal_the_formula(run: tuple[Path, list[dict]], optimizer: str) -> None:
    records = [r[f"{optimizer}_hier"] for r in run[1]]
    assert_node_push_bytes(records, NODES, LOCAL)
