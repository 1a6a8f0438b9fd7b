"""The documentation site: it builds strictly, its commands compose, its tables match the code.

- ``mkdocs build --strict`` into a temporary folder: a broken link or anchor, a missing image, a
  page left out of the nav or an API reference mkdocstrings cannot resolve fails the build.
- Every ``python train.py ...`` command shown on a page composes with Hydra (what ``--cfg job``
  prints), with its ``--config-dir``, multirun sweeps expanded into each job's overrides.
- Each strategy page's options table lists the constructor's keyword arguments with their defaults.
- README's library example is the Home page's (``tests/integration/test_docs_example.py`` runs it).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from app_utils import CONF
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import lightning_strategies as ls

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


# the modules whose every public name (``__all__``) the API reference must render
REFERENCED_MODULES = (
    "lightning_strategies.comm",
    *(f"lightning_strategies.comm.{m}" for m in (
        "ring", "stats", "ps", "async_", "async_ps", "heartbeat", "peer_lost", "abort", "pipeline",
        "pipeline_stages", "tensor", "amp", "streams", "rpc", "elastic",
    )),
    "lightning_strategies.optim",
)


def code_blocks(text: str, languages: tuple[str, ...] = ("bash", "sh", "console", "")) -> list[str]:
    """The fenced code blocks of a markdown text whose language is one of ``languages``."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.strip() == "```":
            if lang in languages:
                blocks.append("\n".join(lines) + "\n")
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def test_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    # the API reference rendered the public API, and the stored figures were published beside the pages
    package = (site / "reference" / "package.html").read_text()
    for name in ls.__all__:
        if name != "__version__":
            assert f'id="lightning_strategies.{name}"' in package, f"{name} is not in the API reference"
    # every public name of the documented modules has its section (an alias may be rendered
    # under the module that defines it: heartbeat's re-exports are documented in peer_lost, abort)
    ids = set()
    for html in (site / "reference").rglob("*.html"):
        ids |= set(re.findall(r'id="(lightning_strategies[\w.]*)"', html.read_text()))
    for module in REFERENCED_MODULES:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            defined_in = getattr(getattr(mod, name), "__module__", None)
            homes = {f"{module}.{name}", f"{defined_in}.{name}"}
            assert homes & ids, f"{module}.{name} is not in the API reference (docs/reference/)"
    assert (site / "benchmarks" / "results" / "stragglers.png").is_file()
    claims = (site / "measured" / "claims.html").read_text()
    assert 'src="../benchmarks/results/stragglers.png"' in claims


@dataclass(frozen=True)
class Command:
    page: str
    line: str
    overrides: tuple[str, ...]
    config_dir: str | None
    multirun: bool


def shown_commands(path: Path) -> list[Command]:
    """Every ``python train.py`` (or ``torchrun ... train.py``) command in the page's code blocks."""
    out = []
    for block in code_blocks(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not a shell line (a YAML or Python block's quote)
                continue
            if "train.py" not in words or "..." in words:
                continue
            launcher = [w for w in words[: words.index("train.py")] if not re.match(r"^\w+=", w)]
            if not launcher or launcher[0] not in ("python", "python3", "srun", "torchrun"):
                continue  # prose in a code block (the package tree), not a command
            args = words[words.index("train.py") + 1 :]
            overrides, config_dir, multirun = [], None, False
            it = iter(args)
            for arg in it:
                if arg in ("-m", "--multirun"):
                    multirun = True
                elif arg == "--cfg":
                    next(it)
                elif arg == "--config-dir":
                    config_dir = next(it)
                else:
                    overrides.append(arg)
            out.append(Command(path.relative_to(DOCS).as_posix(), line.strip(), tuple(overrides), config_dir, multirun))
    return out


COMMANDS = [c for p in PAGES for c in shown_commands(p)]


def test_the_pages_show_commands() -> None:
    # the parser still finds what the Quickstart and how-to pages hold (a reworded page must not empty the test)
    pages = {c.page for c in COMMANDS}
    assert {"quickstart.md", "howto/own-model.md", "howto/multi-node.md", "howto/sweeps.md", "howto/resume.md",
            "howto/large-batches.md", "howto/configuration.md", "howto/gpu-node.md"} <= pages, pages
    assert len(COMMANDS) >= 45, len(COMMANDS)


def jobs(overrides: tuple[str, ...]) -> list[list[str]]:
    """A multirun's jobs: each sweep (``a=1,2``, ``range(...)``) expanded, one override list per job."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            choices.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}: {c.line[:80]}")
def test_shown_command_composes(command: Command) -> None:
    extra = []
    if command.config_dir is not None:
        assert (ROOT / command.config_dir).is_dir(), command.config_dir
        extra.append(f"hydra.searchpath=[file://{ROOT / command.config_dir}]")
    for overrides in jobs(command.overrides) if command.multirun else [list(command.overrides)]:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, *extra], return_hydra_config=True)
        # what `--cfg job` prints: the job's config, every value resolvable but the run-time ones
        job = OmegaConf.to_container(cfg, resolve=False)
        assert isinstance(job, dict) and "strategy" in job and "trainer" in job


def fmt_default(value: object) -> str:
    """A default as the options tables write it."""
    if isinstance(value, datetime.timedelta):
        return f"timedelta(seconds={int(value.total_seconds())})"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


STRATEGY_PAGES = {
    "ring": ls.RingAllReduceStrategy,
    "ps": ls.ParameterServerStrategy,
    "async": ls.AsyncParameterServerStrategy,
    "async_elastic": ls.AsyncElasticStrategy,
    "pipeline": ls.PipelineStrategy,
    "tensor": ls.TensorParallelStrategy,
    "ft": ls.FTStrategy,
}
SECTIONS = ["## When to use it", "## Options", "## Metrics", "## On a fault", "## Not supported", "## GPU status"]


@pytest.mark.parametrize(("page", "cls"), STRATEGY_PAGES.items())
def test_strategy_page_lists_the_constructor_options(page: str, cls: type) -> None:
    text = (DOCS / "strategies" / f"{page}.md").read_text()
    for section in SECTIONS:
        assert f"\n{section}\n" in text, f"strategies/{page}.md has no '{section}' section"
    options = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    shown = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", options, re.M))
    expected = {
        name: fmt_default(p.default)
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind is not p.VAR_KEYWORD
    }
    assert shown == expected, f"strategies/{page}.md's options table differs from {cls.__name__}.__init__"


def python_block(text: str) -> str:
    return code_blocks(text, ("python",))[0]


def test_readme_example_is_the_home_page_example() -> None:
    readme = python_block((ROOT / "README.md").read_text())
    assert readme == python_block((DOCS / "index.md").read_text())
    assert 'strategy="ring"' in readme and len(readme.splitlines()) <= 12


def test_readme_is_short_and_links_into_the_site() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = set(re.findall(r"\]\((docs/[\w/.-]+\.md)(?:#[\w-]+)?\)", text))
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing
    for page in ("quickstart", "choose", "reliability", "architecture", "contributing", "gpu", "reference/index"):
        assert f"docs/{page}.md" in links, f"README has no link to docs/{page}.md"


def load_griffe_extension() -> Any:
    spec = importlib.util.spec_from_file_location("_griffe_roles", DOCS / "_griffe_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def returns_items(text: str) -> list[str]:
    """The descriptions griffe's Google parser reads in the docstring's Returns section."""
    import griffe

    sections = griffe.Docstring(text, parser="google").parse()
    return [item.description for s in sections if s.kind is griffe.DocstringSectionKind.returns for item in s.value]


def test_griffe_extension_keeps_a_returns_literal_whole() -> None:
    # param_groups' Returns is one ``[{...}, {...}]`` literal over two lines at the item's indentation
    from lightning_strategies.optim import param_groups

    text = inspect.cleandoc(param_groups.__doc__ or "")
    assert len(returns_items(text)) == 2  # what griffe reads unaided: the literal cut in two items
    (whole,) = returns_items(load_griffe_extension().join_open_literals(text))
    assert whole.count("``") == 2 and '"layer_adaptation": True}' in whole and "without empty groups" in whole
    # a section without an open literal is left as it was
    plain = "Summary.\n\nReturns:\n    the value.\n    More about it.\n\nRaises:\n    ValueError: never.\n"
    assert load_griffe_extension().join_open_literals(plain) == plain.rstrip("\n")


def test_griffe_extension_shows_rst_math_as_tex_code() -> None:
    # Lamb's docstring: :math:`x` roles and a `.. math::` block, which Markdown would print raw
    from lightning_strategies.optim import Lamb

    text = inspect.cleandoc(Lamb.__doc__ or "")
    out = load_griffe_extension().rst_math(text)
    assert ".. math::" in text and ":math:`" in text
    assert ".. math::" not in out and ":math:" not in out
    fence = out.split("```latex\n", 1)[1].split("\n```", 1)[0]
    block = text.split(".. math::\n", 1)[1].split("\n\n", 1)[0]
    assert fence.splitlines() == [line[4:] for line in block.splitlines()]  # the TeX, as written
    assert "For each parameter tensor `x` with gradient `g`" in out
