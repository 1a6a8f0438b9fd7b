"""Shared test set-up: one torch thread per process (a second thread stalls steps 5-20x on
the 2-vCPU CI machines), deterministic seeds, the environment restored after each test, and
the ``gpu`` skip mark."""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run benchmarks/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _isolated_environ() -> Iterator[None]:
    """Each test sees the environment the session started with.

    Code run in the pytest process leaves variables behind: ``pl.seed_everything`` (the app's
    ``run``) sets ``PL_GLOBAL_SEED``, which makes every later DDP-based fit re-seed its ranks in
    ``setup_environment`` while a one-device reference in the pytest process does not, so their
    dropout masks differ (test_pipeline_strategy's dropout test failed after test_bad_input).
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
