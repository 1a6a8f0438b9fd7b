"""Every figure README cites has its stored output, and every benchmark command it shows has its script.

The project's rule: a figure in README comes from a committed script whose raw output (date,
machine, versions, load) is stored under ``benchmarks/results/`` or ``docs/results/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# a file under a results folder: images, raw outputs, summaries ("results/" alone names the folder)
RESULT = re.compile(r"(?:benchmarks|docs)/results/[\w./-]*\w")
# a command README shows: `python benchmarks/x.py ...`, `bash benchmarks/x.sh`
COMMAND = re.compile(r"\b(?:python|bash)\s+(benchmarks/[\w./-]+\.(?:py|sh))\b")
CITED = sorted(set(RESULT.findall(README)))
SCRIPTS = sorted(set(COMMAND.findall(README)))


def test_readme_cites_results_and_commands() -> None:
    # the patterns still find what README holds (a reworded README must not silence the tests)
    assert len(CITED) >= 5, CITED
    assert len(SCRIPTS) >= 5, SCRIPTS


@pytest.mark.parametrize("path", CITED)
def test_cited_result_file_exists(path: str) -> None:
    assert (ROOT / path).is_file(), f"README cites {path}, which is not in the repository"


@pytest.mark.parametrize("path", [p for p in CITED if p.endswith(".txt")])
def test_cited_raw_output_names_machine_and_date(path: str) -> None:
    # benchmarks/_common.header: "# title | machine, cores, GPU | versions | YYYY-MM-DD"
    first = (ROOT / path).read_text().splitlines()[0]
    assert first.startswith("# ") and "torch" in first, f"{path}: first line {first!r} is not a header"
    assert re.search(r"\d{4}-\d{2}-\d{2}", first), f"{path}: its header has no date: {first!r}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_shown_benchmark_command_names_a_script(script: str) -> None:
    assert (ROOT / script).is_file(), f"README shows a command running {script}, which does not exist"
