"""The library's shape (issue #26's "done when"), measured from the sources so that growth fails here.

- no Python file of the project (the library, ``recipes/``, ``benchmarks/``, ``tests/``, ``docs/``,
  ``examples/``, the top level) over 32 KiB, no class over 400 lines;
- no import circle between the library's modules; ``comm/`` reaches no Lightning, the library
  neither Hydra nor ``recipes``;
- none of torch RPC's internals, no write into a private attribute of a foreign object, and at
  most three private reads of Lightning's trainer or loops, all in one helper module.

Every rule reads the sources with :mod:`ast` (nothing is imported), and each checker is also run
on a small source that breaks its rule, so a checker that stopped finding anything fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

# Internals kept on purpose, each isolated in one function (issue #26: "if a feature cannot be kept
# without an internal, keep the feature, isolate the internal in one function"), with the reason.
_KEPT_INTERNALS = {
    "lightning_strategies/comm/elastic.py:remove_from_torch_rpc_group": (
        "torch's dynamic RPC group forgets only a member that left gracefully; a dead one stays listed and "
        "fails the next join, and torch has no public way to remove it (async_elastic's rejoin needs it); "
        "tests/unit/test_torch_rpc_internals.py fails when torch changes the internals it uses"
    ),
    "lightning_strategies/strategies/_lightning_internals.py:per_rank_sigterm": (
        "Lightning broadcasts a SIGTERM flag on the default group before every training step and has no "
        "switch to turn it off; under async the ranks take different step counts, so it would pair with a "
        "peer's other collective; tests/unit/test_lightning_internals.py pins the attribute"
    ),
}

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("lightning_strategies", "recipes")
#: every tree of the project's own Python: the size rules hold for all of it, not only the library
SIZED = (*PACKAGES, "benchmarks", "tests", "docs", "examples")
MAX_BYTES = 32 * 1024
MAX_CLASS_LINES = 400
# torch.distributed.rpc's internals (and the store key torch writes its worker infos under), and c10d's
# state: its world of groups and their stores (comm.abort keeps its own list of groups; the heartbeat opens
# its own store connection). Any private name of ``distributed_c10d`` (its ``_world``, ...) counts too
# (``_c10d_internal``): listed here, a name as plain as ``_world`` would also flag a class's own attribute.
TORCH_INTERNALS = (
    "_init_counter",
    "_init_counter_lock",
    "_set_rpc_timeout",
    "_get_current_rpc_agent",
    "_update_group_membership",
    "_ALL_WORKER_INFOS",
    "_pg_map",
    "_get_default_group",
    "_get_default_store",
    "_underlying_non_prefix_store",
)
MAX_TRAINER_READS = 3


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not _is_dunder(name)


# -- sizes ----------------------------------------------------------------------------------------


def _long_classes(tree: ast.AST) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                yield node.name, lines


def test_no_file_over_32_kib_and_no_class_over_400_lines() -> None:
    found: list[str] = []
    for path in [*_sources(*SIZED), *sorted(REPO.glob("*.py"))]:
        size = path.stat().st_size
        if size > MAX_BYTES:
            found.append(f"{_rel(path)}: {size} bytes (limit {MAX_BYTES})")
        for name, lines in _long_classes(ast.parse(path.read_text())):
            found.append(f"{_rel(path)}: class {name} has {lines} lines (limit {MAX_CLASS_LINES})")
    assert not found, "split these by idea:\n" + "\n".join(found)


def test_the_class_measure_counts_decorators_out_and_the_body_in() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert list(_long_classes(ast.parse(f"class Big:\n{body}\n"))) == [("Big", MAX_CLASS_LINES + 1)]
    assert not list(_long_classes(ast.parse("@decorated\nclass Small:\n    x = 1\n")))


# -- the import graph -------------------------------------------------------------------------------


def _imported(module: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The library modules ``module`` imports, at the top or inside functions alike.

    ``from a.b import c`` is an import of ``a.b.c`` when that is a module, else of ``a.b``;
    relative imports are resolved against ``module``. Imports under ``if TYPE_CHECKING:`` count
    too: a module that needs another's types depends on it (issue #26 wants ``comm/rpc.py`` a
    leaf). The parent packages an import runs first are not edges: Python runs them before the
    module, and the circle through them is the one every package with submodules has.
    """
    out: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                source = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    out.add(f"{source}.{alias.name}")
                elif source in known:
                    out.add(source)
    out.discard(module)
    return out


def _import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in _sources(*packages)}
    known = set(paths)
    return {
        name: _imported(name, path.name == "__init__.py", ast.parse(path.read_text()), known)
        for name, path in paths.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_round(graph: dict[str, set[str]], component: list[str]) -> str:
    """One circle through the component's first module, for the message: ``a -> b -> a``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return " -> ".join([*paths[v], start])
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return " <-> ".join(component)


def test_no_import_circle_in_the_library() -> None:
    graph = _import_graph(PACKAGES[:1])
    assert "lightning_strategies.comm.ring.allreduce" in graph["lightning_strategies.comm.ring.reducer"]
    circles = list(_circles(graph))
    assert not circles, "import circles:\n" + "\n".join(_path_round(graph, c) for c in circles)


def test_the_circle_finder_resolves_relative_and_function_imports() -> None:
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d"}
    sources = {
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def later():\n    from . import c\n", False),
        "pkg.c": ("from .sub.d import thing\n", False),
        "pkg.sub.d": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
            False,
        ),
        "pkg.sub": ("from .d import thing\n", True),
    }
    graph = {m: _imported(m, pkg, ast.parse(src), known) for m, (src, pkg) in sources.items()}
    assert graph["pkg.c"] == {"pkg.sub.d"} and graph["pkg.sub"] == {"pkg.sub.d"}
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    graph["pkg.sub.d"] = set()
    assert _circles(graph) == []


# -- what the library may reach ---------------------------------------------------------------------


def _external_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_comm_reaches_no_lightning_and_the_library_no_hydra_nor_recipes() -> None:
    graph = _import_graph(PACKAGES[:1])
    paths = {_module_name(p): p for p in _sources(PACKAGES[0])}
    roots = {m: _external_roots(ast.parse(p.read_text())) for m, p in paths.items()}
    lightning = {"lightning", "pytorch_lightning", "lightning_fabric"}
    found = [f"{m} imports {sorted(r & {'hydra', 'omegaconf', 'recipes'})}" for m, r in roots.items()
             if r & {"hydra", "omegaconf", "recipes"}]  # fmt: skip
    comm = [m for m in graph if m.startswith("lightning_strategies.comm")]
    assert "lightning_strategies.comm.ring.transport" in comm
    for start in comm:  # what a comm module runs, through the library's own modules too
        seen, todo = {start}, [start]
        while todo:
            for w in graph[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        reached = sorted(m for m in seen if roots[m] & lightning)
        if reached:
            found.append(f"{start} reaches Lightning through {reached}")
    assert not found, "\n".join(found)


# -- internals of torch and Lightning ------------------------------------------------------------


def _torch_internals(tree: ast.AST) -> list[str]:
    """Uses of torch's RPC and c10d internals: as names, attributes, imported names or inside strings (a store
    key built from one); docstrings, which may name them, are not uses."""
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    hits = []
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
            if _c10d_internal(node.value, node.attr):
                hits.append(f"line {node.lineno}: {node.attr}")
                continue
        elif isinstance(node, ast.ImportFrom):
            hits += [f"line {node.lineno}: {a.name}" for a in node.names if _c10d_internal(node.module, a.name)]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.alias):
            names = [node.name.split(".")[-1]]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [n for n in TORCH_INTERNALS if n in node.value]
        hits += [f"line {getattr(node, 'lineno', '?')}: {n}" for n in names if n in TORCH_INTERNALS]
    return hits


def _c10d_internal(owner: ast.expr | str | None, name: str) -> bool:
    """Whether ``owner.name`` (an attribute, or a name imported from module ``owner``) is a private name of
    ``torch.distributed.distributed_c10d`` not already in :data:`TORCH_INTERNALS`."""
    if isinstance(owner, ast.Attribute):
        owner = owner.attr
    elif isinstance(owner, ast.Name):
        owner = owner.id
    private = name.startswith("_") and not name.startswith("__") and name not in TORCH_INTERNALS
    return private and isinstance(owner, str) and owner.split(".")[-1] == "distributed_c10d"


def _ours(tree: ast.Module) -> set[str]:
    """The module-level names a module defines or imports from this repository's packages."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES)
    return names


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The attribute targets an assignment statement writes (tuple targets unpacked)."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while todo:
        t = todo.pop(0)
        if isinstance(t, ast.Tuple | ast.List):
            todo += t.elts
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _private_writes(tree: ast.Module) -> list[tuple[str, str]]:
    """``(function, "line N: X._name = ...")`` for assignments to ``X._name`` where ``X`` is not
    ``self`` / ``cls`` nor a module-level name of ours (defined in the module, or imported from
    this repository's packages).

    The rule is about the object written into, ``X`` (the attribute's owner, whatever the chain
    before it): ``self._step = 1`` is the class's own state, ``self.trainer._x = 1`` and
    ``loop._x = f`` write into Lightning's, ``options._timeout = t`` into torch's. Dunder names
    are not private. Writes through ``setattr`` or ``obj.__dict__[...]`` are not attribute
    assignments and are not counted. ``function`` is the innermost enclosing function's name
    (``""`` at module level).
    """
    ours = _ours(tree) | {"self", "cls"}
    hits: list[tuple[str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for t in _assigned(node):
            owner_is_ours = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ours
            if isinstance(t, ast.Attribute) and _is_private(t.attr) and not owner_is_ours:
                hits.append((function, f"line {t.lineno}: {ast.unparse(t)} = ..."))
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            visit(child, inner)

    visit(tree, "")
    return hits


def _trainer_reads(tree: ast.AST) -> list[str]:
    """Reads of a private attribute of Lightning's trainer, its loops or its connectors.

    ``trainer._x`` / ``self.trainer._x``, ``loop._x`` / ``fit_loop._x`` / ``x.epoch_loop._x``, and
    ``_*_connector`` wherever it is read.
    """
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_private(node.attr)):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        trainerish = name == "trainer" or name == "loop" or name.endswith("_loop")
        if trainerish or node.attr.endswith("_connector"):
            hits.append(f"line {node.lineno}: {ast.unparse(node)}")
    return hits


def _kept_lines(tree: ast.AST, path: str) -> set[int]:
    """The lines of the functions in ``_KEPT_INTERNALS`` (where an internal may be used)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and f"{path}:{node.name}" in _KEPT_INTERNALS:
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _line_of(hit: str) -> int:
    return int(hit.split(":")[0].removeprefix("line "))


def test_kept_internals_exist_where_they_are_listed() -> None:
    # a kept function that moved or was renamed must leave the list (else it would exempt nothing)
    for key in _KEPT_INTERNALS:
        path, function = key.split(":")
        tree = ast.parse((REPO / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert function in names, key


def test_no_torch_internals_and_no_private_writes() -> None:
    found: list[str] = []
    for path in _sources(*PACKAGES):
        tree = ast.parse(path.read_text())
        kept = _kept_lines(tree, _rel(path))
        found += [f"{_rel(path)} {hit}" for hit in _torch_internals(tree) if _line_of(hit) not in kept]
        found += [
            f"{_rel(path)} {hit}"
            for function, hit in _private_writes(tree)
            if f"{_rel(path)}:{function}" not in _KEPT_INTERNALS
        ]
    assert not found, "\n".join(found)


def test_at_most_three_private_trainer_reads_all_in_one_module() -> None:
    reads = {_rel(p): _trainer_reads(ast.parse(p.read_text())) for p in _sources(*PACKAGES)}
    reads = {path: hits for path, hits in reads.items() if hits}
    total = sum(len(hits) for hits in reads.values())
    assert len(reads) <= 1 and total <= MAX_TRAINER_READS, reads


def test_the_internal_finders_find_what_they_describe() -> None:
    source = (
        "import lightning_strategies.comm.ring.transport as transport\n"
        "from torch.distributed import rpc\n"
        "_STATE = {}\n"
        "class A:\n"
        "    def f(self, trainer, options, loop):\n"
        "        self._ok = 1\n"
        "        transport._patched = 2\n"
        "        options._timeout = 3\n"
        "        self.trainer._cache += 4\n"
        "        loop._hook: int = 5\n"
        "        self.__dict__['_x'] = 6\n"
        "        rpc._init_counter = 0\n"
        "        key = '_ALL_WORKER_INFOS'\n"
        "        store = dist.distributed_c10d._get_default_store()\n"
        "        names = dist.distributed_c10d._world.pg_names\n"
        "        from torch.distributed.distributed_c10d import _store_based_barrier, is_initialized\n"
        "        self._world = store.world_size\n"
        "        return trainer._logger_connector, trainer.fit_loop.epoch_loop._batches, self._state\n"
    )
    tree = ast.parse(source)
    writes = _private_writes(tree)
    assert {function for function, _ in writes} == {"f"}
    assert [w.split(": ")[1] for _, w in writes] == [
        "options._timeout = ...",
        "self.trainer._cache = ...",
        "loop._hook = ...",
        "rpc._init_counter = ...",
    ]
    # in ast.walk's order (a statement before what it holds); self._world is the class's own, not c10d's
    assert [h.split(": ")[1] for h in _torch_internals(tree)] == [
        "_store_based_barrier",
        "_init_counter",
        "_ALL_WORKER_INFOS",
        "_get_default_store",
        "_world",
    ]
    assert [h.split(": ")[1] for h in _trainer_reads(tree)] == [
        "trainer._logger_connector",
        "trainer.fit_loop.epoch_loop._batches",
    ]
