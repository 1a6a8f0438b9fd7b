"""The multi-process test runner; it lives in ``benchmarks/_workers.py``, shared with the benchmarks."""

from benchmarks._workers import free_port, run_workers

__all__ = ["free_port", "run_workers"]
