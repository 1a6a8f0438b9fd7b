"""The multi-process test runner; it lives in ``benchmarks/_workers.py``, shared with the benchmarks."""

from __future__ import annotations

from benchmarks._workers import reserved_port, run_workers

__all__ = ["reserved_port", "run_workers"]
