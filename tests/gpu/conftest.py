"""Fixtures of the GPU suite (``tests/gpu``; helpers in ``gpu_utils.py``).

Every module here sets ``pytestmark = pytest.mark.gpu``; ``tests/conftest.py`` skips those tests
when CUDA is missing, so ``pytest -m gpu`` collects the suite everywhere and runs it only on a
GPU machine (``benchmarks/gpu_check.sh`` runs it there). ``tests/integration/test_gpu_check.py`` checks on
CPU that the suite is collected, marked and covers every strategy. ``LS_GPU_SUITE_ON_CPU=1`` runs
it on the CPU instead, to try the suite's own machinery without a GPU (see ``gpu_utils.py``).

Multi-rank tests start their ranks with ``spawn``, never ``fork``: a process that has touched CUDA
cannot fork a child that uses it.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import ON_CPU, suite_device


@pytest.fixture
def cuda() -> torch.device:
    """The device under test (the first GPU), its cache emptied so one test's allocations do not
    show in the next."""
    if not ON_CPU:
        torch.cuda.empty_cache()
    return suite_device()
