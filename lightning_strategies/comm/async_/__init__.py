"""The async parameter server's coordination (no Lightning import): :class:`AsyncCoordinator` (hosted by
rank 0; :mod:`.endpoints` has its RPC entry points) composes SSP clocks (:mod:`.clocks`), the batch queue
(:mod:`.queue`), membership (:mod:`.membership`) and deadlines (:mod:`.watchdog`); :class:`BatchLease`
(:mod:`.lease`) is the worker's side; :mod:`.messages` what they exchange.
"""

from lightning_strategies.comm.async_.coordinator import AsyncCoordinator
from lightning_strategies.comm.async_.endpoints import (
    hosted_coordinator,
    local_coordinator,
    register_coordinator,
    unregister_coordinator,
)
from lightning_strategies.comm.async_.lease import (
    DEFAULT_LEASE,
    BatchLease,
    fetch_published,
    join_run,
    leave_run,
    report_failure,
)
from lightning_strategies.comm.async_.messages import RECORD_LIMIT, DataPlan, JoinReply, LeasedBatch, LeaseReply

__all__ = [
    "DEFAULT_LEASE",
    "RECORD_LIMIT",
    "AsyncCoordinator",
    "BatchLease",
    "DataPlan",
    "JoinReply",
    "LeaseReply",
    "LeasedBatch",
    "fetch_published",
    "hosted_coordinator",
    "join_run",
    "leave_run",
    "local_coordinator",
    "register_coordinator",
    "report_failure",
    "unregister_coordinator",
]
