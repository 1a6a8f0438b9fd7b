"""Fixtures of the GPU suite (``tests/gpu``; helpers in ``gpu_utils.py``).

Every module here sets ``pytestmark = pytest.mark.gpu``; ``tests/conftest.py`` skips those tests
when CUDA is missing, so ``pytest -m gpu`` collects the suite everywhere and runs it only on a
GPU machine (``benchmarks/gpu_check.sh`` runs it there). ``tests/integration/test_gpu_check.py`` checks on
CPU that the suite is collected, marked and covers every strategy. ``LS_GPU_SUITE_ON_CPU=1`` runs
the modules that set ``CPU_DRY_RUN = True`` on the CPU instead, to try their machinery without a
GPU (see ``gpu_utils.py``); the others are skipped then.

Multi-rank tests start their ranks with ``spawn``, never ``fork``: a process that has touched CUDA
cannot fork a child that uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_utils import ON_CPU, own_process_group, suite_device


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ON_CPU:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="CUDA only: not part of the CPU dry run (LS_GPU_SUITE_ON_CPU=1)")
    for item in items:
        module = getattr(item, "module", None)
        if here in Path(str(item.path)).parents and not getattr(module, "CPU_DRY_RUN", False):
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    """The device under test (the first GPU), its cache emptied so one test's allocations do not
    show in the next."""
    if not ON_CPU:
        torch.cuda.empty_cache()
    return suite_device()


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """A default process group a test made in this process (a world-1 fit, ``init_process_group``) is
    destroyed after it: Lightning destroys its own only at exit, and a later fit or test would find it
    and run on its backend, or fail to make its own."""
    with own_process_group():
        yield
