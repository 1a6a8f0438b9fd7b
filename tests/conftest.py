"""Shared test set-up: one torch thread per process (a second thread stalls steps 5-20x on
the 2-vCPU CI machines), deterministic seeds, the environment restored after each test, and
the ``gpu`` skip mark."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # Lightning's "popen" launcher starts the other ranks by re-running the command line: a test
    # that fits a multi-process Trainer in the pytest process with it would start a second whole
    # test session as rank 1. Tests fork their ranks (start_method="fork") or run scripts in
    # subprocesses; a session started as a Lightning child rank stops here, loudly.
    if os.environ.get("LOCAL_RANK", "0") != "0":
        sys.stderr.write(
            "tests/conftest.py: this pytest session was started as a Lightning child rank "
            f"(LOCAL_RANK={os.environ['LOCAL_RANK']}): a test fitted a multi-process Trainer with the "
            "'popen' launcher in the pytest process. Fix: start_method='fork' (or '*_fork' strategies), "
            "or run the script in a subprocess.\n"
        )
        os._exit(3)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # LS_GPU_SUITE_ON_CPU=1: run the GPU suite on the CPU, to try its machinery (tests/gpu/gpu_utils.py)
    if torch.cuda.is_available() or os.environ.get("LS_GPU_SUITE_ON_CPU") == "1":
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


@pytest.fixture(autouse=True)
def _rank_zero_restored() -> Iterator[None]:
    """Each test starts with the rank-zero gate as it found it.

    Lightning's ``LightningEnvironment.set_global_rank`` (called by strategies and by tests that
    build a cluster environment for rank 3 of 4) sets the process-wide ``rank_zero_only.rank``,
    which silences every later ``rank_zero_warn`` / ``rank_zero_info`` in the pytest process:
    ``test_async_ps``'s momentum-warning test failed when run after ``test_strategy_base``.
    """
    from lightning_utilities.core.rank_zero import rank_zero_only

    had = hasattr(rank_zero_only, "rank")
    saved = getattr(rank_zero_only, "rank", None)
    yield
    if had:
        rank_zero_only.rank = saved
    elif hasattr(rank_zero_only, "rank"):
        del rank_zero_only.rank

