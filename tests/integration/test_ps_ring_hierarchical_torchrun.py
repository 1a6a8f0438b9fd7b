"""``ps_ring``'s hierarchical push under two torchrun "nodes" of 2 processes each, on 127.0.0.1.

``torchrun --nnodes 2 --nproc-per-node 2`` twice (static rendezvous; ``_torchrun_utils``), each worker running
``_ps_ring_hier_torchrun.py``: three fits, ``RingParameterServerStrategy()`` (hierarchical, chosen from Lightning's
``TorchElasticEnvironment`` on 2 nodes), ``hierarchical=False``, and the hierarchical one clipped by norm. Checked:

- the choice: hierarchical on the launcher's 2 nodes, flat when asked; each process owns a quarter of every
  bucket, the four quarters covering it;
- the hierarchical weights and the optimizer state gathered from its shards equal the flat ring's, and DDP's on
  4 fork-started processes (clipped: DDP's clipped). Every path divides the sum of the four gradients by 4: the
  flat ring sums in ring order, the hierarchical one sums each node's pair, then the two node sums, gloo in its
  own order; the float32 sums differ by about an ulp of the gradient per step, far below ``atol=1e-6`` after 6
  SGD-momentum steps, while a wrong layout (a node's sum missing, or divided by 2 instead of 4) moves the
  weights by > 1e-3;
- the bytes: per step each process sends ``2 (N-1)/N x 1/L`` of the model's 212 float32 gradients across nodes
  (``comm/inter_node_bytes_sent``; 3 buckets, each cut into halves and quarters, so up to 3 elements of uneven
  chunking) and ``2 (P-1)/P`` of them in all, as the flat ring does: the same bytes, fewer of them across.

One launch, one test (two torchrun agents, four workers, three fits: ~25 s on 2 loaded cores), so that no two
xdist workers launch it twice.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from _torchrun_utils import run_torchrun_nodes
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor, fit_weights

pytestmark = pytest.mark.slow

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
SCRIPT = Path(__file__).with_name("_ps_ring_hier_torchrun.py")
N_PARAMS = 8 * 16 + 16 + 16 * 4 + 4  # TinyRegressor
FITS = ("hier", "flat", "hier_clip")


def test_hierarchical_push_under_torchrun(tmp_path: Path) -> None:
    run_torchrun_nodes(["--out-dir", str(tmp_path)], nnodes=NODES, nproc_per_node=LOCAL, log_dir=tmp_path,
                       script=SCRIPT, timeout=400)  # fmt: skip
    run = (tmp_path, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)])
    push_is_hierarchical_on_the_launchers_nodes(run)
    hierarchical_equals_flat_and_ddp(run)
    bytes_across_nodes_are_the_hierarchical_rings(run)


def push_is_hierarchical_on_the_launchers_nodes(run: tuple[Path, list[dict]]) -> None:
    for name in FITS:
        records = [r[name] for r in run[1]]
        for record in records:
            assert record["hierarchical"] is name.startswith("hier"), (name, record)
        # the four owned chunks of every bucket cover it, once each
        for b, numel in enumerate(records[0]["bucket_numel"]):
            chunks = sorted(tuple(r["owned"][b]) for r in records)
            assert chunks[0][0] == 0 and chunks[-1][1] == numel, (name, chunks)
            assert all(x[1] == y[0] for x, y in itertools.pairwise(chunks)), (name, chunks)


def hierarchical_equals_flat_and_ddp(run: tuple[Path, list[dict]]) -> None:
    hier, flat, clip = (torch.load(run[0] / f"{name}.pt", weights_only=False) for name in FITS)
    # the same samples per step as the torchrun fits (_torchrun_fit.make_loader: 8 per process, in order)
    ddp = fit_weights(DDPStrategy(start_method="fork"), WORLD)
    ddp_clipped = fit_weights(DDPStrategy(start_method="fork"), WORLD, gradient_clip_val=0.05)
    for k in ddp:
        for got, want in ((hier, ddp), (flat, ddp), (clip, ddp_clipped)):
            torch.testing.assert_close(got["weights"][k], want[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert any(not torch.allclose(clip["weights"][k], ddp[k], rtol=0, atol=1e-5) for k in ddp)  # clipping acted
    start = TinyRegressor().state_dict()
    assert max(float((hier["weights"][k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained
    state_h, state_f = hier["optimizer"]["state"], flat["optimizer"]["state"]
    assert sorted(state_h) == sorted(state_f) == [0, 1, 2, 3]
    for i in state_h:
        torch.testing.assert_close(state_h[i]["momentum_buffer"], state_f[i]["momentum_buffer"], rtol=0, atol=1e-6)


def bytes_across_nodes_are_the_hierarchical_rings(run: tuple[Path, list[dict]]) -> None:
    for record in run[1]:
        for name in ("hier", "hier_clip"):
            metrics = record[name]["metrics"]
            across = 2 * (NODES - 1) / NODES * N_PARAMS / LOCAL * 4
            assert abs(metrics["comm/inter_node_bytes_sent"] - across) <= 3 * 4, (name, metrics)
            assert abs(metrics["comm/inter_node_bytes_received"] - across) <= 3 * 4, (name, metrics)
        for name in FITS:
            metrics = record[name]["metrics"]
            assert abs(metrics["comm/bytes_sent"] - 2 * (WORLD - 1) / WORLD * N_PARAMS * 4) <= 6 * 4, (name, metrics)
        assert "comm/inter_node_bytes_sent" not in record["flat"]["metrics"]
