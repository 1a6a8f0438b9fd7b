"""Two "nodes" on one machine: ``torchrun --nnodes 2 --nproc-per-node 1`` twice, static rendezvous
on 127.0.0.1, trains ``ring``, ``ps`` and ``pipeline`` to the weights of the 2-process single-node run.

Nothing in our strategies looks at nodes (Lightning's ``TorchElasticEnvironment`` turns
torchrun's ``GROUP_RANK``/``RANK``/``WORLD_SIZE`` into node and global ranks), so the same two
processes must compute the same thing whether one torchrun or two started them.

Tolerance: both runs execute the same float32 operations in the same order on the same data (the
reference is the same fit, fork-started on one node), so the weights should be bitwise equal; we
allow ``atol=1e-6`` (the bound to which ring/ps/pipeline already match DDP at P=2/3), because
gloo may pick another algorithm for a collective when it sees two hosts' worth of processes. A wrong
rank mapping (a node reading the other's data slice twice, a pipeline stage on the wrong node)
moves the weights by >1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _torchrun_fit import fit, make_strategy
from _torchrun_utils import run_torchrun_nodes
from lightning_utils import TinyRegressor

pytestmark = pytest.mark.slow

MAX_STEPS = 6
ATOL = 1e-6


@pytest.mark.parametrize("name", ["ring", "ps", "pipeline"])
def test_two_nodes_train_like_one_node(name: str, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    run_torchrun_nodes(
        ["--strategy", name, "--num-nodes", "2", "--devices", "1", "--max-steps", str(MAX_STEPS), "--out", str(out)],
        nnodes=2,
        nproc_per_node=1,
        log_dir=tmp_path,
    )
    got = torch.load(out, weights_only=True)
    want = fit(name, make_strategy(name, start_method="fork"), devices=2, max_steps=MAX_STEPS)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=ATOL, msg=lambda m, k=k: f"{name} {k}: {m}")
    # and it trained (a fit that skipped its steps on both sides would pass the comparison above)
    start = TinyRegressor().state_dict()
    assert max(float((got[k] - start[k]).abs().max()) for k in got) > 1e-3
