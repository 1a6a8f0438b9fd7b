"""Communication algorithms over :mod:`torch.distributed`, free of any Lightning import.

Plain functions and classes over tensors and a process group, counted in :class:`CommStats`.
"""

from lightning_strategies.comm.heartbeat import Heartbeat, PeerDiagnosis, PeerLostError, start_heartbeat
from lightning_strategies.comm.ps import OptimizerSpec, ParameterServerClient, ParameterShard, shard_parameters
from lightning_strategies.comm.ring import RingBucketReducer, RingPeerError, ring_all_reduce
from lightning_strategies.comm.stats import CommStats

__all__ = [
    "CommStats",
    "Heartbeat",
    "OptimizerSpec",
    "ParameterServerClient",
    "ParameterShard",
    "PeerDiagnosis",
    "PeerLostError",
    "RingBucketReducer",
    "RingPeerError",
    "ring_all_reduce",
    "shard_parameters",
    "start_heartbeat",
]
