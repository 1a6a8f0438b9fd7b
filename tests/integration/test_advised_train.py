"""`python train.py strategy=advised cluster=<preset> trainer=ddp_sim`: the first choice trains; why is logged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from app_utils import FEW_BATCHES, run_train

from lightning_strategies.advisor import STRATEGIES

pytestmark = pytest.mark.slow

# the digits ResNet at 16 px and 16 per device: the advisor's block timing and 2 steps take seconds
SMALL = ["data.image_size=16", "data.batch_size=16"]


def test_advised_trains_with_the_first_choice_and_logs_why(tmp_path: Path) -> None:
    # no choice inherited from this process (the app's unit tests resolve strategy=advised in it)
    proc = run_train(["strategy=advised", "cluster=loopback", "trainer=ddp_sim", "hydra.run.dir=run", *FEW_BATCHES,
                      *SMALL], cwd=tmp_path, timeout=240, env={"LS_ADVISED": ""})  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    why = re.search(r"strategy=advised: strategy=(\w+)(.*?) on loopback \(predicted step ([0-9.e+-]+) s, .*?\): (.+)",
                    out)  # fmt: skip
    assert why, out[-4000:]
    chosen = "ps1" if why.group(1) == "ps" and "num_servers=1" in why.group(2) else why.group(1)
    assert chosen in STRATEGIES and float(why.group(3)) > 0 and why.group(4).strip()
    # the table was printed, with the chosen strategy ranked first
    first = re.search(r"│\s+1 │ (\w+)[^│]*│\s+[0-9.e+-]+ │", out)  # rank 1, its step time
    assert first and first.group(1) == chosen, out[-4000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 2 and metrics["world_size"] == 2
    # every rank built the launcher's choice: a rank with another strategy would have failed the first step
    assert metrics["strategy"] == f"advised:{chosen}"
    assert (tmp_path / "run" / "train.log").read_text().count("strategy=advised: ") == 1
