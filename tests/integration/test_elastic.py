"""Elastic restart: under ``torchrun --max-restarts 1`` a worker SIGKILLed mid-training is
restarted with its peer, both resume from the last checkpoint, and training completes with the
weights of an uninterrupted run.

Rank 1 kills itself at the start of global step 6, in the second epoch (4 steps per epoch), once:
a marker file keeps the restarted attempt alive. ``ModelCheckpoint(every_n_epochs=1,
save_last=True)`` wrote ``last.ckpt`` at the end of epoch 1 (step 4); the restarted attempt resumes
there (``ckpt_path`` = ``last.ckpt`` when it exists), so steps 4-5 run twice in wall time but once
in the model's history. Epoch boundaries only: Lightning 2.6 restarts a plain DataLoader from
batch 0 after a mid-epoch resume.

Rendezvous is ``c10d``, and the restarted workers join their process group through a store
prefixed by the attempt (``lightning_strategies.strategies._elastic``, part of every strategy of
ours): with torch 2.14 the restarted group otherwise reads the dead attempt's gloo addresses from
the agent's store and fails to connect (under ``static`` and ``c10d`` alike), for Lightning's own
``ddp`` too; this test fails without it.

Tolerance: the restarted attempt loads the exact float32 weights and SGD momentum buffers that the
checkpoint holds and then runs the same operations on the same batches as the uninterrupted run,
so the weights are compared exactly (``atol=0``); ring at P=2 already equals DDP bitwise, and ps
runs the same SGD on its shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _torchrun_fit import fit, make_strategy
from _torchrun_utils import run_torchrun_nodes

pytestmark = pytest.mark.slow

MAX_EPOCHS = 3  # 4 steps of global batch 16 each
DIE_AT_STEP = 6


@pytest.mark.parametrize("name", ["ring", "ps"])
def test_killed_worker_is_restarted_and_resumes_from_last_checkpoint(name: str, tmp_path: Path) -> None:
    out, ckpt_dir, marker = tmp_path / "weights.pt", tmp_path / "ckpt", tmp_path / "killed"
    args = ["--strategy", name, "--devices", "2", "--max-epochs", str(MAX_EPOCHS), "--out", str(out),
            "--ckpt-dir", str(ckpt_dir), "--die-rank", "1", "--die-at-step", str(DIE_AT_STEP),
            "--die-marker", str(marker)]  # fmt: skip
    run_torchrun_nodes(
        args, nnodes=1, nproc_per_node=2, max_restarts=1, rdzv_backend="c10d", log_dir=tmp_path, timeout=150
    )

    assert marker.exists(), "rank 1 never reached the step where it kills itself"
    attempts = Path(f"{out}.attempts").read_text().split()
    # first attempt from scratch, the restarted one from last.ckpt of epoch 1 (step 4), not 0
    io = "checkpoint_io=AtomicCheckpointIO"  # our strategies' default
    env = "env=TorchElasticEnvironment"
    assert attempts == ["restart=0", "start_step=0", io, env, "restart=1", "start_step=4", io, env], attempts
    got = torch.load(out, weights_only=True)
    want = fit(name, make_strategy(name, start_method="fork"), devices=2, max_epochs=MAX_EPOCHS)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{name} {k}: {m}")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]  # no temp files
