"""Sharded parameter servers (no Lightning import): plan, optimizer spec, wire format, shard, client.

Rank ``r`` hosts shard ``r`` (``r < num_servers``): its slices of the flattened trainable tensors
(:mod:`.plan`) and the user's optimizer rebuilt over them (:mod:`.spec`), so the optimizer runs on the
servers. Workers (:mod:`.client`) push gradients and pull values, one payload per shard each way
(:mod:`.wire`); on several nodes they push through their node (:mod:`.hierarchy`). The synchronous
shard (:mod:`.shard`; hosted, and reached by RPC, through :mod:`.hosting`) is a barrier, which takes a
worker's step in parts when its pushes overlap backward (:mod:`.buckets`); the asynchronous one
(:mod:`lightning_strategies.comm.async_ps`) builds on the same pieces. Where every rank hosts a shard, the
shards may instead sit where the ring's reduce-scatter leaves its chunks (:mod:`.ring_shards`, the state in
checkpoints :mod:`.ring_shard_state`): pushes and pulls are then the ring's two halves, without RPC.
"""

from lightning_strategies.comm.ps.bucket_replies import BucketwisePush
from lightning_strategies.comm.ps.buckets import Bucket, OverlappedPush, StepTimeline, plan_buckets
from lightning_strategies.comm.ps.client import ParameterServerClient, broadcast_from_rank0
from lightning_strategies.comm.ps.hierarchy import HierarchicalParameterServerClient, PushLayout, node_nic_bytes
from lightning_strategies.comm.ps.hosting import hosted_shard, local_shard, register_shard, unregister_shard
from lightning_strategies.comm.ps.plan import (
    PARTITION_ALIGN,
    Slice,
    partition_loads,
    partition_parameters,
    partition_per_group,
    shard_loads,
    shard_parameters,
    whole_tensor_slices,
)
from lightning_strategies.comm.ps.ring_shard_state import gather_ring_state, load_ring_state
from lightning_strategies.comm.ps.ring_shards import RingBucket, RingShards, RingStepTimes
from lightning_strategies.comm.ps.shard import ParameterShard, ShardReply
from lightning_strategies.comm.ps.spec import OptimizerSpec
from lightning_strategies.comm.ps.wire import Packed, pack, payload_bytes, slice_of, unpack

__all__ = [
    "PARTITION_ALIGN",
    "Bucket",
    "BucketwisePush",
    "HierarchicalParameterServerClient",
    "OptimizerSpec",
    "OverlappedPush",
    "Packed",
    "ParameterServerClient",
    "ParameterShard",
    "PushLayout",
    "RingBucket",
    "RingShards",
    "RingStepTimes",
    "ShardReply",
    "Slice",
    "StepTimeline",
    "broadcast_from_rank0",
    "gather_ring_state",
    "hosted_shard",
    "load_ring_state",
    "local_shard",
    "node_nic_bytes",
    "pack",
    "partition_loads",
    "partition_parameters",
    "partition_per_group",
    "payload_bytes",
    "plan_buckets",
    "register_shard",
    "shard_loads",
    "shard_parameters",
    "slice_of",
    "unpack",
    "unregister_shard",
    "whole_tensor_slices",
]
