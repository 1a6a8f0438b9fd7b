"""Two "nodes" on one machine: ``torchrun --nnodes 2 --nproc-per-node 1`` twice, static rendezvous
on 127.0.0.1, trains ``ring``, ``ps``, ``ps1`` and ``pipeline`` to the weights of the 2-process
single-node run; so do two tasks of a simulated ``srun --nodes 2 --ntasks-per-node 1`` (the variables SLURM sets,
read by Lightning's ``SLURMEnvironment``). ``async`` runs through both launchers too; its
updates depend on arrival order, so it is held to training (loss down), not to equal weights.

Across nodes (one process each) ``ps`` and ``ps1`` (one server, 256-byte buckets: two) answer every
bucket alone (``reply_per_bucket=None`` decides it on), while the one-node reference answers once per
shard and step: the weights must not tell the two apart (each tensor's update reads only its own
gradient and state), and the test checks that the two-node run did answer per bucket.

Nothing else that looks at nodes changes what a step computes (Lightning's ``TorchElasticEnvironment`` turns
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
from _torchrun_utils import run_slurm_tasks, run_torchrun_nodes
from lightning_utils import TinyRegressor, regression_data

pytestmark = pytest.mark.slow

MAX_STEPS = 6
ASYNC_EPOCHS = 3  # 8 batches of 8 per epoch, shared by both workers
ATOL = 1e-6


def _two_node_args(name: str, out: Path) -> list[str]:
    # async trains whole epochs: its ranks take different numbers of steps per epoch
    length = ["--max-epochs", str(ASYNC_EPOCHS)] if name == "async" else ["--max-steps", str(MAX_STEPS)]
    return ["--strategy", name, "--num-nodes", "2", "--devices", "1", *length, "--out", str(out)]


@pytest.mark.parametrize("name", ["ring", "ps", "ps1", "pipeline"])
def test_two_nodes_train_like_one_node(name: str, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    run_torchrun_nodes(_two_node_args(name, out), nnodes=2, nproc_per_node=1, log_dir=tmp_path)
    if name.startswith("ps"):  # one process per node: the flat push crosses nodes, each bucket answered alone
        assert Path(f"{out}.replies").read_text().split() == ["replies_per_bucket=True"]
    _assert_like_one_node(name, torch.load(out, weights_only=True))


@pytest.mark.parametrize("name", ["ring", "ps", "pipeline"])
def test_two_slurm_nodes_train_like_one_node(name: str, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    run_slurm_tasks(_two_node_args(name, out), ntasks=2, log_dir=tmp_path)
    assert "env=SLURMEnvironment" in Path(f"{out}.attempts").read_text()  # Lightning took SLURM's ranks
    _assert_like_one_node(name, torch.load(out, weights_only=True))


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_async_runs_on_two_nodes(launcher: str, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    if launcher == "torchrun":
        run_torchrun_nodes(_two_node_args("async", out), nnodes=2, nproc_per_node=1, log_dir=tmp_path)
    else:
        run_slurm_tasks(_two_node_args("async", out), ntasks=2, log_dir=tmp_path)
    got = torch.load(out, weights_only=True)
    assert got.keys() == TinyRegressor().state_dict().keys()
    assert _loss(got) < 0.5 * _loss(TinyRegressor().state_dict())  # it trained, on both nodes' pushes


def _loss(weights: dict[str, torch.Tensor]) -> float:
    model = TinyRegressor()
    model.load_state_dict(weights)
    data = regression_data()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]))


def _assert_like_one_node(name: str, got: dict[str, torch.Tensor]) -> None:
    want = fit(name, make_strategy(name, start_method="fork"), devices=2, max_steps=MAX_STEPS)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=ATOL, msg=lambda m, k=k: f"{name} {k}: {m}")
    # and it trained (a fit that skipped its steps on both sides would pass the comparison above)
    start = TinyRegressor().state_dict()
    assert max(float((got[k] - start[k]).abs().max()) for k in got) > 1e-3
