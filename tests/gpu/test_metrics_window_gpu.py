"""MetricsWindow with CUDA tensors: no host synchronisation per sample, one read at flush."""

from __future__ import annotations

import pytest
import torch
from gpu_utils import no_host_sync

from lightning_strategies.strategies._base import MetricsWindow

pytestmark = pytest.mark.gpu
CPU_DRY_RUN = True  # LS_GPU_SUITE_ON_CPU=1 runs it on the CPU (gpu_utils.py)


def test_metrics_window_never_waits_for_the_gpu_before_flush(cuda: torch.device) -> None:
    window = MetricsWindow()
    values = torch.arange(1.0, 9.0, device=cuda)  # made before the block: its upload is not a sample's cost
    with no_host_sync():  # raises on the first host sync: .item(), float(), a blocking copy
        for step in range(8):
            v = values[step]
            window.add(loss=v, seconds=0.25)
            window.peak(grad_norm_max=v * 2)
            window.latest(clock=v)
    # sums are float64 on the device: exact for these small integers, like the float path
    assert window.flush() == {"loss": 4.5, "seconds": 0.25, "grad_norm_max": 16.0, "clock": 8.0}
    assert not window


def test_metrics_window_keeps_each_devices_tensors_on_it(cuda: torch.device) -> None:
    window = MetricsWindow()
    window.add(gpu=torch.tensor(3.0, device=cuda), cpu=torch.tensor(1.0))
    window.add(gpu=torch.tensor(5.0, device=cuda), cpu=torch.tensor(2.0))
    assert window._sums["gpu"].device == cuda and window._sums["cpu"].device.type == "cpu"  # type: ignore[union-attr]
    assert window.flush() == {"gpu": 4.0, "cpu": 1.5}
