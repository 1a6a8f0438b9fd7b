"""The old import path of :mod:`lightning_strategies.comm.async_` (the coordinator and its messages)."""

from lightning_strategies.comm.async_.coordinator import AsyncCoordinator
from lightning_strategies.comm.async_.endpoints import _rpc_run_state
from lightning_strategies.comm.async_.messages import (
    RECORD_LIMIT,
    DataPlan,
    GateReply,
    JoinReply,
    LeasedBatch,
    LeaseReply,
    ReportReply,
)

__all__ = [
    "RECORD_LIMIT",
    "AsyncCoordinator",
    "DataPlan",
    "GateReply",
    "JoinReply",
    "LeaseReply",
    "LeasedBatch",
    "ReportReply",
    "_rpc_run_state",
]
