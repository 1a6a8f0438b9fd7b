"""The hierarchical ring under two torchrun "nodes" of 2 processes each, on 127.0.0.1.

``torchrun --nnodes 2 --nproc-per-node 2`` twice (static rendezvous; ``_torchrun_utils``), each
worker running ``_ring_hier_torchrun.py``: Lightning finds torchrun's environment
(``TorchElasticEnvironment``), the ``"ring"`` strategy reads the node layout from it and, seeing 2
nodes, reduces hierarchically. Checked:

- the choice and the layout: hierarchical, nodes ``[[0, 1], [2, 3]]`` (torchrun's numbering);
- the fit's weights equal DDP's on the same 4 processes and batches (fork-started, one node):
  DDP divides each gradient by 4 and lets gloo sum, the ring sums in its own order and divides;
  the sums of 4 float32 values differ by a few ulps, far below ``atol=1e-6`` after 6 SGD-momentum
  steps with lr 0.05 (test_multinode's bound), while a wrong layout (a rank reducing with the
  wrong peers, or averaging over 2 instead of 4) moves the weights by > 1e-3;
- the logged ``comm/inter_node_bytes_sent``: the model's 212 float32 gradients are one bucket
  per step; each process sends 2(N-1)/N x 212/L x 4 = 424 bytes of it to the other node, and
  ``comm/intra_node_bytes_sent`` 2(L-1)/L x 212 x 4 = 848 bytes inside its own;
- ``hierarchical_all_reduce`` on that layout equals ``dist.all_reduce`` (float64: 1e-14 of the
  value scale, a few ulps of P-1 additions in another order), identical on every process, with
  2(N-1)/N x numel/L elements sent across nodes by each (up to 3 elements of uneven chunking).

One launch serves the three tests (a module fixture): two torchrun agents and four workers that
import Lightning take 25-40 s on 2 loaded cores, the price of the only test in which the node
layout comes from a real launcher's environment rather than a layout built by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _torchrun_fit import fit
from _torchrun_utils import run_torchrun_nodes
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor

pytestmark = pytest.mark.slow

NODES, LOCAL = 2, 2
SCRIPT = Path(__file__).with_name("_ring_hier_torchrun.py")
N_PARAMS = 8 * 16 + 16 + 16 * 4 + 4  # TinyRegressor


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("ring_hier")
    run_torchrun_nodes(["--out-dir", str(out)], nnodes=NODES, nproc_per_node=LOCAL, log_dir=out, script=SCRIPT,
                       timeout=240)  # fmt: skip
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * LOCAL)]


def test_ring_is_hierarchical_on_the_launchers_nodes(run: tuple[Path, list[dict]]) -> None:
    for record in run[1]:
        assert record["env"] == "TorchElasticEnvironment", record
        assert record["hierarchical"] is True, record
        assert record["nodes"] == [[0, 1], [2, 3]], record
        metrics = record["metrics"]
        assert metrics["comm/inter_node_bytes_sent"] == 2 * (NODES - 1) / NODES * N_PARAMS / LOCAL * 4, metrics
        assert metrics["comm/inter_node_bytes_received"] == metrics["comm/inter_node_bytes_sent"], metrics
        assert metrics["comm/intra_node_bytes_sent"] == 2 * (LOCAL - 1) / LOCAL * N_PARAMS * 4, metrics
        assert metrics["comm/calls"] == 1.0, metrics


def test_hierarchical_fit_equals_ddp(run: tuple[Path, list[dict]]) -> None:
    got = torch.load(run[0] / "weights.pt", weights_only=True)
    want = fit("ring", DDPStrategy(start_method="fork"), devices=NODES * LOCAL, max_steps=6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    start = TinyRegressor().state_dict()
    assert max(float((got[k] - start[k]).abs().max()) for k in got) > 1e-3  # it trained


def test_hierarchical_all_reduce_equals_all_reduce_under_torchrun(run: tuple[Path, list[dict]]) -> None:
    for record in run[1]:
        for row in record["compare"]:
            assert row["max_err"] <= 1e-14 * row["scale"], row
            assert row["identical_on_ranks"], row
            inter = 2 * (NODES - 1) / NODES * row["numel"] / LOCAL * 8
            assert abs(row["inter_node_bytes_sent"] - inter) <= 3 * 8, row
            assert abs(row["inter_node_bytes_received"] - inter) <= 3 * 8, row
