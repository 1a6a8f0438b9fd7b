"""The torchft Lighthouse as its own process: what :func:`~lightning_strategies.comm.ft.start_lighthouse` runs.

    python _lighthouse_main.py --min_replicas 2 --bind [::]:0 ...   (LS_LIGHTHOUSE_PARENT=<pid>)

torchft's ``lighthouse_main`` parses the process's own arguments from the second on, as for the wheel's
``torchft_lighthouse`` script, so this file's path stands where that script's would. Before the server
starts, the process asks the kernel for SIGTERM when the thread that started it ends (Linux
``PR_SET_PDEATHSIG``) and exits at once if that parent is already gone: a launcher that dies, even of
SIGKILL, leaves no Lighthouse behind. The server comes from the wheel's extension module loaded by itself,
without ``import torchft`` (which imports torch first, ~1 s per launch, for nothing the server needs).

Nothing here may import ``lightning_strategies``: the file runs as a script, outside the package.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

PARENT_ENV = "LS_LIGHTHOUSE_PARENT"
_PR_SET_PDEATHSIG = 1


def _lighthouse_main() -> Callable[[], int]:
    """torchft's ``lighthouse_main``, from its extension module alone where the wheel has the file."""
    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        for path in sorted(Path(folder).glob("_torchft*")):
            if path.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
                ext = importlib.util.spec_from_file_location("torchft._torchft", path)
                if ext is not None and ext.loader is not None:
                    module = importlib.util.module_from_spec(ext)
                    ext.loader.exec_module(module)
                    return module.lighthouse_main
    from torchft._torchft import lighthouse_main  # another layout: the package import, as the wheel's script

    return lighthouse_main


def main() -> int:
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent and os.getppid() != parent:
        return 0  # the launcher ended before the request above was in place
    return int(_lighthouse_main()() or 0)


if __name__ == "__main__":
    sys.exit(main())
