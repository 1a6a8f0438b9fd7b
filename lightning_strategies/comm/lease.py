"""The old import path of :mod:`lightning_strategies.comm.async_.lease` (the worker's lease)."""

from lightning_strategies.comm.async_.lease import (
    DEFAULT_LEASE,
    BatchLease,
    fetch_published,
    join_run,
    leave_run,
    report_failure,
)

__all__ = ["DEFAULT_LEASE", "BatchLease", "fetch_published", "join_run", "leave_run", "report_failure"]
