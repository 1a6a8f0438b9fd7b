"""Every benchmark script runs in --quick mode and prints `name value unit` lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
LINE = re.compile(r"^[A-Za-z0-9_.]+ -?[0-9.]+(e[-+]?[0-9]+)? \S+$")
# Bounds the quick run must meet, per script: (name pattern, low, high); each pattern must match
# at least one line. wire_bytes: kernel-counted bytes over the payload formula; framing adds a
# few %, a wrong formula or a miscounted socket is off by a factor (0.5, 2, P).
GOALS: dict[str, list[tuple[str, float, float]]] = {
    # the flattened partition's busiest shard over the mean (ResNet-50's tensors): arithmetic
    "ps_traffic.py": [(f"ps_busiest_over_mean_bytes_resnet50_S{s}", 1.0, 1.05) for s in (8, 64, 256)],
    "wire_bytes.py": [(f"wire_over_formula_{c}_P2", 0.9, 2.0) for c in ("ddp", "ring", "ring_bf16", "ps", "ps_1")],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_mode(script: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines and lines[0].startswith("# "), "the first line names machine, versions and date"
    results = [x for x in lines if LINE.match(x)]
    assert results, proc.stdout[-2000:]
    for x in results:
        assert x.split()[1] not in ("nan", "inf")
    values = {x.split()[0]: float(x.split()[1]) for x in results}
    for pattern, low, high in GOALS.get(script, []):
        matched = {k: v for k, v in values.items() if re.fullmatch(pattern, k)}
        assert matched, f"no line matches {pattern!r}:\n{proc.stdout[-2000:]}"
        off = {k: v for k, v in matched.items() if not low <= v <= high}
        assert not off, f"outside [{low}, {high}]: {off}"
