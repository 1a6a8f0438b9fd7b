"""Every figure README and the documentation site cite has its stored output, and every benchmark
command they show has its script.

The project's rule: a figure comes from a committed script whose raw output (date, machine,
versions, load) is stored under ``benchmarks/results/`` or ``docs/results/``. A text cites a
stored result by its path in the repository (``benchmarks/results/x.txt``) or links to it
(``![plot](../../benchmarks/results/x.png)`` from ``docs/measured/``); both count.

README is short (at most 200 lines): it keeps one headline figure, so it must cite at least that
figure's raw output and plot and show the command that made them. The figures themselves live on
the site's pages, which must cite at least 30 stored results and show at least 15 benchmark
commands: the counts the pages held when the figures moved there from README (35 results, 18
commands), with a margin, so that a reworded page cannot silence these tests.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# a file under a results folder: images, raw outputs, summaries ("results/" alone names the folder)
RESULT = re.compile(r"(?:benchmarks|docs)/results/[\w./-]*\w")
# a command a text shows: `python benchmarks/x.py ...`, `bash benchmarks/x.sh`
COMMAND = re.compile(r"\b(?:python|bash)\s+(benchmarks/[\w./-]+\.(?:py|sh))\b")
# the target of a markdown link or image
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def link_targets(path: Path) -> list[str]:
    """The repository paths the file's relative links point to, as GitHub resolves them."""
    out = []
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith(("#", "mailto:", "/")):
            continue
        out.append(posixpath.normpath(posixpath.join(posixpath.dirname(rel(path)), target.split("#")[0])))
    return out


def cited_results(path: Path) -> set[str]:
    linked = {t for t in link_targets(path) if RESULT.fullmatch(t)}
    return set(RESULT.findall(path.read_text())) | linked


def shown_scripts(path: Path) -> set[str]:
    return set(COMMAND.findall(path.read_text()))


SOURCES = [README, *PAGES]
CITED = sorted({(rel(p), r) for p in SOURCES for r in cited_results(p)})
SCRIPTS = sorted({(rel(p), s) for p in SOURCES for s in shown_scripts(p)})
LINKS = sorted({(rel(p), t) for p in SOURCES for t in link_targets(p)})


def test_readme_cites_its_headline_figure() -> None:
    results = cited_results(README)
    assert any(r.endswith(".txt") for r in results) and any(r.endswith(".png") for r in results), results
    assert len(shown_scripts(README)) >= 1


def test_site_cites_results_and_commands() -> None:
    # the patterns still find what the pages hold (a reworded page must not silence the tests)
    results = set().union(*(cited_results(p) for p in PAGES))
    scripts = set().union(*(shown_scripts(p) for p in PAGES))
    assert len(results) >= 30, sorted(results)
    assert len(scripts) >= 15, sorted(scripts)
    # the README's figure is on the site too, with its method
    assert cited_results(README) <= results


@pytest.mark.parametrize(("source", "path"), CITED)
def test_cited_result_file_exists(source: str, path: str) -> None:
    assert (ROOT / path).is_file(), f"{source} cites {path}, which is not in the repository"


@pytest.mark.parametrize(("source", "path"), [c for c in CITED if c[1].endswith(".txt")])
def test_cited_raw_output_names_machine_and_date(source: str, path: str) -> None:
    # benchmarks/_common.header: "# title | machine, cores, GPU | versions | YYYY-MM-DD"
    first = (ROOT / path).read_text().splitlines()[0]
    assert first.startswith("# ") and "torch" in first, f"{path} (cited by {source}): {first!r} is not a header"
    assert re.search(r"\d{4}-\d{2}-\d{2}", first), f"{path} (cited by {source}): its header has no date: {first!r}"


@pytest.mark.parametrize(("source", "script"), SCRIPTS)
def test_shown_benchmark_command_names_a_script(source: str, script: str) -> None:
    assert (ROOT / script).is_file(), f"{source} shows a command running {script}, which does not exist"


@pytest.mark.parametrize(("source", "target"), LINKS)
def test_relative_link_resolves_in_the_repository(source: str, target: str) -> None:
    # what GitHub shows: README's links into docs/, the pages' links to figures outside docs/
    assert (ROOT / target).exists(), f"{source} links to {target}, which is not in the repository"
