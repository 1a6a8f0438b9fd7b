"""``benchmarks/scale.py --plot-from``: the figures drawn again from a stored output.

The reference is the stored output itself (``benchmarks/results/scale.txt``): what ``plot_from`` reads
back must be every projected strategy and world that ``scale.py`` projects, with the printed values.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _scale_plots
from benchmarks._common import printed_values
from benchmarks.scale import PROJECTED, PROJECTED_STRATEGIES

STORED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "scale.txt"


def test_plot_from_reads_back_every_projected_strategy_and_world(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: dict[str, Any] = {}
    monkeypatch.setattr(_scale_plots, "plot_projection", lambda cluster, proj, path: drawn.update(proj=proj))
    monkeypatch.setattr(_scale_plots, "plot_traffic", lambda cluster, proj, path: drawn.update(traffic=proj))
    monkeypatch.setattr(_scale_plots, "plot_validation", lambda results, path: drawn.update(results=results))
    _scale_plots.plot_from(STORED)
    proj, values = drawn["proj"], printed_values(STORED)
    assert list(proj) == list(PROJECTED_STRATEGIES)  # in the projection's order (the legend's)
    for s in PROJECTED_STRATEGIES:
        assert sorted(proj[s]) == list(PROJECTED)
        for p in PROJECTED:
            assert proj[s][p].step_s == values[f"projected_step_s_{s}_P{p}"]
            assert proj[s][p].nic_bytes == values[f"projected_nic_bytes_{s}_P{p}"]
    measured = [k for k in values if k.startswith("scale_measured_step_s_")]
    assert len(drawn["results"]) == len(measured) > 0


def test_plot_from_draws_three_figures_and_refuses_another_output(tmp_path: Path) -> None:
    stored = tmp_path / "scale.txt"
    shutil.copy(STORED, stored)
    _scale_plots.plot_from(stored)
    for name in ("scale.png", "scale_traffic.png", "scale_validation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.txt"
    other.write_text("ps_over_ddp_step 1.155 x\n")
    with pytest.raises(SystemExit, match=r"other\.txt has no projection \(found 1 lines.*Fix: --plot-from"):
        _scale_plots.plot_from(other)
