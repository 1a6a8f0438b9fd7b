"""The async parameter server's coordination, with no Lightning import: SSP clocks, batch leases,
membership, and the coordinator that composes them (hosted by rank 0), with the worker's lease.

- :mod:`.messages`: the data plan, leased batches and the replies workers get.
- :mod:`.clocks`: the staleness bound's clocks. :mod:`.queue`: the epochs' batch queues, leased by
  speed. :mod:`.membership`: a fixed or a changing set of workers. :mod:`.watchdog`: deadlines.
- :mod:`.coordinator`: :class:`AsyncCoordinator`, composing them; :mod:`.endpoints`: its registry
  and RPC entry points; :mod:`.lease`: the worker's side (:class:`BatchLease`).
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
