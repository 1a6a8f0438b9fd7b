"""``benchmarks/allreduce.py --quick`` runs and prints the lines it promises (CI smoke run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_allreduce_benchmark_quick_mode(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("allreduce_bench", ROOT / "benchmarks" / "allreduce.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))
    try:
        spec.loader.exec_module(module)
        assert module.main(["--quick"]) == 0
    finally:
        sys.path.remove(str(ROOT))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ring all-reduce") and "torch" in lines[0]
    rows = [line.split() for line in lines[1:] if not line.startswith("#")]  # "#": comments (load average)
    values = {name: float(value) for name, value, _ in rows}
    names = ("ring_over_gloo", "ring_bf16_over_gloo", "ps_over_gloo", "bytes_over_formula")
    diagnostics = ("xfer_over_gloo", "xfer_bf16_over_gloo", "bf16_casts_over_gloo")
    for name in names + diagnostics:
        assert f"{name}_P2_N65.536K" in values, lines
    assert values["bytes_over_formula_P2_N65.536K"] == 1.0
    # Each diagnostic ran (a positive time, so a positive ratio).
    assert all(values[f"{name}_P2_N65.536K"] > 0 for name in diagnostics), lines
    # The hierarchical ring at 2 nodes x 2 (P = 4): byte accounting, exact (see test_benchmarks.py).
    assert values["ring_hier_over_gloo_P4_N65.536K"] > 0, lines
    assert values["hier_inter_node_bytes_over_flat"] == pytest.approx(1 / 3, abs=1e-3), lines
    assert values["hier_inter_node_bytes_over_formula"] == 1.0, lines
