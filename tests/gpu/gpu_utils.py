"""Helpers of the GPU suite (importable as ``gpu_utils`` from its test modules)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["no_host_sync"]


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise on any operation that makes the host wait for the device (``.item()``, ``bool()``, a
    blocking copy to the host, ...) inside the block: ``torch.cuda.set_sync_debug_mode("error")``."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()  # work queued before the block is not the block's
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
