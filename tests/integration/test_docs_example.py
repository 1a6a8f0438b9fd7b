"""README's library example (also the documentation's Home page) runs as it is shown.

The example is saved as a script and run with ``python``: Lightning's launcher re-runs it as the
second rank, both train under ``RingAllReduceStrategy``. The reference is the arithmetic of the
run: 256 samples over 2 ranks in batches of 32 are 4 steps an epoch, 8 in the 2 epochs it asks for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from app_utils import pythonpath

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_example_trains_with_the_ring(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    check = (
        "\nif trainer.global_rank == 0:\n"
        "    print('RESULT', trainer.global_step, type(trainer.strategy).__name__, trainer.world_size)\n"
    )
    script.write_text(readme_example() + check)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath()}
    # its own process group, so a timeout also ends the rank Lightning started
    with subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    assert proc.returncode == 0, stderr[-3000:]
    assert "RESULT 8 RingAllReduceStrategy 2" in stdout, stdout[-2000:] + stderr[-2000:]
