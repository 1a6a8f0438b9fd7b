"""mkdocs hooks: the stored benchmark results published beside the pages.

Figures live where their scripts write them, ``benchmarks/results/``, outside ``docs/``. The pages
link to them by their path in the repository (``../../benchmarks/results/x.png`` from
``docs/measured/``), which is what GitHub shows. mkdocs only knows files under ``docs/``, so
``on_files`` adds every file of ``benchmarks/results/`` to the site as ``benchmarks/results/...``
and ``on_page_markdown`` rewrites a link that leaves ``docs/`` for such a file into the link to
that copy. A link to anything else outside ``docs/`` is left alone, so the strict build reports it.

Diagrams are mermaid, which the material theme loads from a CDN unless ``mermaid`` is already
defined. ``make docs`` vendors the pinned npm package's ``mermaid.min.js`` into
``docs/javascripts/vendor/`` (git-ignored, 3.5 MB) where npm is available; ``on_config`` adds it
to the pages, so the site renders its diagrams offline. Without it the theme's CDN load is used.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ("benchmarks/results",)
# the target of a markdown link or image: ](target) or ](target "title")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?P<rest>(?:\s+\"[^\"]*\")?)\)")


def published_files() -> list[str]:
    """Paths (from the repository root) of the stored results the site carries."""
    out: list[str] = []
    for folder in PUBLISHED:
        out += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*") if p.is_file())
    return out


MERMAID = "javascripts/vendor/mermaid.min.js"


def on_config(config: MkDocsConfig, **_: Any) -> MkDocsConfig:
    if (Path(config.docs_dir) / MERMAID).is_file() and MERMAID not in [str(s) for s in config.extra_javascript]:
        config.extra_javascript.append(MERMAID)
    return config


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    for rel in published_files():
        files.append(File.generated(config, rel, abs_src_path=str(ROOT / rel)))
    return files


def rewrite_links(markdown: str, page_src_uri: str) -> str:
    """Links from the page ``docs/<page_src_uri>`` to ``benchmarks/results/...`` made site-relative."""
    page_dir = posixpath.dirname(page_src_uri)

    def fix(match: re.Match[str]) -> str:
        target = match["target"]
        if "://" in target or target.startswith(("#", "/", "mailto:")):
            return match[0]
        path, _, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join("docs", page_dir, path))
        if not in_repo.startswith(tuple(f"{p}/" for p in PUBLISHED)):
            return match[0]
        new = posixpath.relpath(in_repo, page_dir or ".")
        return f"]({new}{'#' + anchor if anchor else ''}{match['rest']})"

    return LINK.sub(fix, markdown)


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    return rewrite_links(markdown, page.file.src_uri)
