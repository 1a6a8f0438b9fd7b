"""The multi-process test runner; it lives in ``benchmarks/_workers.py``, shared with the benchmarks."""

from __future__ import annotations

from benchmarks._workers import end_ranks, reserved_port, run_workers, start_ranks

__all__ = ["end_ranks", "reserved_port", "run_workers", "start_ranks"]
