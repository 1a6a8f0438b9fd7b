"""The GPU suite (``tests/gpu``) is collected and skipped on a machine without CUDA, every test in it
is marked ``gpu``, and it covers every strategy, the optimizers, the prefetcher and mixed precision.

(On a GPU machine the suite runs for real: ``benchmarks/gpu_check.sh``.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

#: what the suite must exercise on a GPU, as fragments of its test ids
REQUIRED = {
    **{f"strategy {s}": f"test_strategies_gpu.py::test_world_1_on_the_gpu_equals_the_cpu[{s}]"
       for s in ("ddp", "ring", "ring_bf16", "ps", "async", "pipeline", "tensor")},
    "two ranks on one GPU": "test_two_ranks_on_one_gpu_over_gloo_equal_one_cpu_process[ddp]",
    "lamb foreach": "test_optim_gpu.py::test_foreach_on_cuda_equals_the_per_tensor_update_on_the_cpu[lamb]",
    "lars foreach": "test_optim_gpu.py::test_foreach_on_cuda_equals_the_per_tensor_update_on_the_cpu[lars]",
    "device prefetcher": "test_prefetch_gpu.py::test_batches_equal_the_loaders_and_are_copied_on_a_side_stream",
    "bf16-mixed": "test_precision_gpu.py::test_bf16_mixed_on_the_gpu_is_close_to_fp32_on_the_cpu[ring]",
    "16-mixed": "test_precision_gpu.py::test_16_mixed_on_the_gpu_is_close_to_fp32_on_the_cpu[ps]",
    "metrics without host syncs": "test_metrics_window_gpu.py::test_metrics_window_never_waits_for_the_gpu",
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the suite runs for real (gpu_check.sh)")
def test_gpu_suite_is_collected_marked_and_skipped_without_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LS_GPU_SUITE_ON_CPU"}
    # no -m: a test in tests/gpu without the gpu mark would run (and fail or pass), not be skipped
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/gpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    results = dict(re.findall(r"^(tests/gpu/\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", proc.stdout, re.M))
    assert proc.returncode == 0 and results, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(results.values()) == {"SKIPPED"}, {k: v for k, v in results.items() if v != "SKIPPED"}
    assert "needs CUDA" in proc.stdout  # skipped by the gpu mark (tests/conftest.py), not by chance
    missing = [what for what, fragment in REQUIRED.items() if not any(fragment in test for test in results)]
    assert missing == [], f"the GPU suite lacks: {missing}"
