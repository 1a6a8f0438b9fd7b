"""``benchmarks/gpu_check.sh`` on a machine without CUDA: it runs the GPU suite (``tests/gpu``), which is
collected and skipped, every test in it marked ``gpu``, covering every strategy, the optimizers,
the prefetcher and mixed precision; it says that no CUDA is there and stops cleanly, with no
ResNet-50 figure. (On a GPU machine the suite and the benchmark run for real.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a subprocess running the suite's collection (~12 s)

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
    "pipeline stages on one GPU": "test_pipeline_gpu.py::test_two_stages_on_one_gpu_equal_the_cpu",
    "pipeline mixed precision": "test_pipeline_gpu.py::test_mixed_precision_stages_on_one_gpu_are_close_to_fp32",
    "pipeline fp16 overflow": "test_pipeline_gpu.py::test_16_mixed_overflow_skips_the_step_and_halves_the_scale",
    "pipeline step without host syncs": "test_pipeline_gpu.py::test_a_step_never_waits_for_the_gpu",
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the suite and the benchmark run for real")
def test_gpu_check_without_cuda_collects_and_skips_the_whole_suite() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LS_GPU_SUITE_ON_CPU"}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=ROOT, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "cuda_available 0 flag" in out and "gpu_tests_failed 0 flag" in out, out[-3000:]
    assert "resnet50_images_per_s" not in out  # no figure without a GPU
    # the suite runs without -m: a test in tests/gpu lacking the gpu mark would run, not be skipped
    results = dict(re.findall(r"^(tests/gpu/\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", out, re.M))
    assert results and set(results.values()) == {"SKIPPED"}, {k: v for k, v in results.items() if v != "SKIPPED"}
    assert "needs CUDA" in out  # skipped by the gpu mark (tests/conftest.py), not by chance
    missing = [what for what, fragment in REQUIRED.items() if not any(fragment in test for test in results)]
    assert missing == [], f"the GPU suite lacks: {missing}"
