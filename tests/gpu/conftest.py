"""Fixtures of the GPU suite (``tests/gpu``; helpers in ``gpu_utils.py``).

Every module here sets ``pytestmark = pytest.mark.gpu``; ``tests/conftest.py`` skips those tests
when CUDA is missing, so ``pytest -m gpu`` collects the suite everywhere and runs it only on a
GPU machine (``benchmarks/gpu_check.sh`` runs it there). ``tests/unit/test_gpu_suite.py`` checks on
CPU that the suite is collected, marked and covers every strategy.

Multi-rank tests start their ranks with ``spawn`` or in a subprocess, never ``fork``: a process
that has touched CUDA cannot fork a child that uses it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    """The first GPU, with its caches emptied so one test's allocations do not show in the next."""
    torch.cuda.empty_cache()
    return torch.device("cuda", 0)
