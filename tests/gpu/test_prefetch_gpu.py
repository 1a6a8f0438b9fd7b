"""DevicePrefetcher on CUDA: batches equal the loader's, copied on a side stream one step ahead, and
the loader state it reports leaves out the batch copied ahead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_strategies.data as data_module
from lightning_strategies.data import DevicePrefetcher, ResumableDataLoader

pytestmark = pytest.mark.gpu  # CUDA streams and pinned memory: not part of the CPU dry run


def test_batches_equal_the_loaders_and_are_copied_on_a_side_stream(
    cuda: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = DataLoader(TensorDataset(torch.arange(64.0).view(16, 4), torch.arange(16)), batch_size=4, pin_memory=True)
    copy_streams: list[Any] = []
    to_device = data_module._to_device

    def recording(batch: Any, device: torch.device, non_blocking: bool) -> Any:
        copy_streams.append(torch.cuda.current_stream(device))
        return to_device(batch, device, non_blocking)

    monkeypatch.setattr(data_module, "_to_device", recording)
    prefetcher = DevicePrefetcher(loader, cuda)
    got = []
    for x, y in prefetcher:
        # the default stream waited for the copy: a kernel on it reads the finished batch
        got.append((x * 1, y + 0))
        assert x.device == cuda and y.device == cuda
    default = torch.cuda.default_stream(cuda)
    assert len(copy_streams) == 4 and all(s != default for s in copy_streams)
    for (x, y), (want_x, want_y) in zip(got, loader, strict=True):
        assert torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)  # a copy: exactly equal


def test_state_excludes_the_batch_copied_ahead(cuda: torch.device) -> None:
    loader = ResumableDataLoader(TensorDataset(torch.arange(12)), batch_size=3, pin_memory=True)
    prefetched = DevicePrefetcher(loader, cuda)
    it = iter(prefetched)
    next(it), next(it)
    assert loader.state_dict()["batches"] == 3  # batch 3 is on its way to the GPU
    assert prefetched.state_dict() == {"epoch": None, "batches": 2, "complete": False}
