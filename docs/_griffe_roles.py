"""A griffe extension: what the library's docstrings write that Google style has no form for.

- Sphinx roles (``:class:`~lightning_strategies.comm.ring.NodeLayout```): mkdocstrings does not
  read them, so each becomes an *optional* autorefs link: a link where the object has a page in
  the API reference, plain code where it has none (a private helper), never an unresolved one.
- RST math (``:math:`x```, ``.. math::``): shown as its TeX source, in code (the site loads no
  TeX renderer: it works offline).
- RST's escaped space after inline code (``fsync``\\ ed): dropped, as Sphinx renders it.
- A Returns or Yields item whose ``...`` literal spans lines at the item's own indentation:
  griffe reads each line as an item; the continuation lines are indented.
- Parameters described together (``rank, world: this rank and the number of ranks.``): griffe
  reads one parameter named ``rank, world``, absent from the signature. Each name gets its own
  entry with the shared description.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(?P<tilde>~?)(?P<target>[\w.]+)`")


def qualify(target: str, obj: griffe.Object | None) -> str:
    """``target`` as a full path: a bare name is looked up from ``obj`` outwards (class, module)."""
    scope = obj
    head = target.split(".", 1)[0]
    while scope is not None and "." not in target.lstrip("~"):
        try:
            if head in scope.members:
                return f"{scope.path}.{target}"
        except Exception:  # an alias that does not resolve: keep looking outwards
            pass
        scope = scope.parent
    return target


def convert(text: str, obj: griffe.Object | None = None) -> str:
    """``text`` with every Sphinx role replaced by an optional autorefs link."""

    def link(match: re.Match[str]) -> str:
        target = qualify(match["target"], obj)
        title = target.rsplit(".", 1)[-1] if match["tilde"] else match["target"]
        return f'<autoref identifier="{html.escape(target)}" optional><code>{html.escape(title)}</code></autoref>'

    return ROLE.sub(link, text)


MATH_ROLE = re.compile(r":math:`(?P<tex>[^`]+)`")
MATH_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. math::\s*$")


def rst_math(text: str) -> str:
    """RST math as code: ``:math:`x``` becomes inline code, a ``.. math::`` block a ``latex`` fence.

    The site renders no TeX (it would load MathJax or KaTeX from a CDN, and the site works
    offline), so the formulas are shown as their TeX source, as written.
    """
    text = MATH_ROLE.sub(lambda m: f"`{m['tex']}`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        head = MATH_DIRECTIVE.match(lines[i])
        if head is None:
            out.append(lines[i])
            i += 1
            continue
        indent = head["indent"]
        i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        depth = min(len(b) - len(b.lstrip()) for b in body if b.strip()) if any(b.strip() for b in body) else 0
        out.append(f"{indent}```latex")
        out.extend(f"{indent}{b[depth:]}" if b.strip() else "" for b in body)
        out.append(f"{indent}```")
        if i < len(lines):
            out.append("")
    return "\n".join(out)


RETURNS = re.compile(r"^(?P<indent>\s*)(?:Returns|Yields):\s*$")


def join_open_literals(text: str) -> str:
    """Lines of a Returns or Yields section that continue an open ``...`` literal, indented.

    Google style wants a continuation line indented deeper than its item; a line at the item's own
    indentation starts a new item, so a literal that spans two lines (``[{...},`` then ``{...}]``)
    became two items, each with half of the literal. While a literal is open such a line is
    indented as the continuation it is.
    """
    lines = text.splitlines()
    out: list[str] = []
    section_indent: int | None = None
    item_indent: int | None = None
    open_literal = False
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if RETURNS.match(line):
            section_indent, item_indent, open_literal = len(line) - len(line.lstrip()), None, False
        elif section_indent is not None and line.strip() and indent <= section_indent:
            section_indent = None  # the section ended
        elif section_indent is not None and line.strip():
            if item_indent is None:
                item_indent = indent
            if open_literal and indent == item_indent:
                line = " " * 4 + line
            open_literal ^= line.count("``") % 2 == 1
        out.append(line)
    return "\n".join(out)


SECTION = re.compile(r"^(?P<indent>\s*)(?:Args|Arguments|Parameters|Keyword Args|Other Parameters):\s*$")
GROUPED = re.compile(r"^(?P<indent>\s+)(?P<names>\**\w+(?:\s*,\s*\**\w+)+):(?P<text>.*)$")


def split_grouped_parameters(text: str) -> str:
    """``a, b: text`` in an Args section written as ``a: text`` and ``b: text``."""
    lines = text.splitlines()
    out: list[str] = []
    section_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        head = SECTION.match(line)
        if head:
            section_indent = len(head["indent"])
        elif line.strip() and section_indent is not None and len(line) - len(line.lstrip()) <= section_indent:
            section_indent = None  # the section ended
        grouped = GROUPED.match(line) if section_indent is not None else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        indent = len(grouped["indent"])
        body = [grouped["text"]]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
            body.append("\n" + lines[i])
            i += 1
        for name in re.split(r"\s*,\s*", grouped["names"]):
            out.append(f"{grouped['indent']}{name}:{''.join(body)}")
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring griffe loads (roles, grouped parameters)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = re.sub(r"(?<=`)\\ ", "", obj.docstring.value)
            text = split_grouped_parameters(convert(rst_math(text), obj))
            obj.docstring.value = join_open_literals(text)
