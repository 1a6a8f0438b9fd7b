"""Package boundaries: the library imports without Hydra or recipes; comm/ has no Lightning."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_strategies

LIB = Path(lightning_strategies.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_comm_has_no_lightning_imports() -> None:
    paths = sorted((LIB / "comm").rglob("*.py"))
    found = {p.relative_to(LIB / "comm").as_posix() for p in paths}
    assert {"ring/allreduce.py", "ps/client.py", "heartbeat.py"} <= found  # the glob looks where comm/ is
    for path in paths:
        assert not _imports(path) & {"lightning", "pytorch_lightning", "lightning_fabric"}, path.name


def test_library_never_imports_hydra_or_recipes() -> None:
    for path in sorted(LIB.rglob("*.py")):
        assert not _imports(path) & {"hydra", "omegaconf", "recipes"}, path


def test_imports_with_hydra_unavailable() -> None:
    code = (
        "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None; sys.modules['recipes'] = None\n"
        "import lightning_strategies, lightning_strategies.optim\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'ring' in StrategyRegistry and 'ps' in StrategyRegistry\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_public_api_is_declared_and_documented() -> None:
    import lightning_strategies.comm as comm
    import lightning_strategies.optim as optim

    for module in (lightning_strategies, comm, optim):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj):
                assert obj.__doc__, f"{module.__name__}.{name} has no docstring"
