"""Fault tolerance and low-communication data parallelism on torchft, free of Lightning.

- :mod:`~lightning_strategies.comm.ft.lighthouse`: the quorum service's address, reachability, start.
- :mod:`~lightning_strategies.comm.ft.replica`: one process = one replica group (torchft Manager).
- :mod:`~lightning_strategies.comm.ft.step`: all-reduce, then commit only if every replica may.
- :mod:`~lightning_strategies.comm.ft.outer`: LocalSGD / (Streaming) DiLoCo's outer loop.
- :mod:`~lightning_strategies.comm.ft.buffers`: the buffers (BatchNorm statistics) at the outer sync.
- :mod:`~lightning_strategies.comm.ft.transport`: the checkpoint transport, at the replica's own address.
- :mod:`~lightning_strategies.comm.ft.streaming`: its syncs on the Manager, blocking or overlapped.

torchft is imported only where a Manager or a Lighthouse is built (``pip install
lightning-strategies[ft]``); everything else here imports without it.
"""

from lightning_strategies.comm.ft.buffers import average_buffers, floating_buffers
from lightning_strategies.comm.ft.lighthouse import (
    LighthouseHandle,
    LighthouseUnreachableError,
    check_lighthouse,
    lighthouse_command,
    parse_lighthouse,
    start_lighthouse,
)
from lightning_strategies.comm.ft.outer import ALGORITHMS, OuterLoop, check_sync_delay, split_fragments
from lightning_strategies.comm.ft.replica import ReplicaConfig, ReplicaGroup, snapshot
from lightning_strategies.comm.ft.step import (
    CommitFailedError,
    CommitStats,
    average_and_commit,
    flatten,
    unflatten_into,
)
from lightning_strategies.comm.ft.streaming import OuterSync, PendingSync, SyncRecord

__all__ = [
    "ALGORITHMS",
    "CommitFailedError",
    "CommitStats",
    "LighthouseHandle",
    "LighthouseUnreachableError",
    "OuterLoop",
    "OuterSync",
    "PendingSync",
    "ReplicaConfig",
    "ReplicaGroup",
    "SyncRecord",
    "average_and_commit",
    "average_buffers",
    "check_lighthouse",
    "check_sync_delay",
    "flatten",
    "floating_buffers",
    "lighthouse_command",
    "parse_lighthouse",
    "snapshot",
    "split_fragments",
    "start_lighthouse",
    "unflatten_into",
]
