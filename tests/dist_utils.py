"""The multi-process test runner; it lives in ``benchmarks/_workers.py``, shared with the benchmarks."""

from __future__ import annotations

from benchmarks._workers import free_port, reserved_port, run_workers

__all__ = ["free_port", "reserved_port", "run_workers"]
