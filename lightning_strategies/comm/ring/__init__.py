"""Ring all-reduce over torch.distributed point-to-point messages, with byte accounting.

Modules: :mod:`.layout`, :mod:`.check`, :mod:`.allreduce`, :mod:`.halves` (reduce-scatter and all-gather on
their own), :mod:`.transport`, :mod:`.reducer` (the DDP hook's thread).
"""

from lightning_strategies.comm.ring.allreduce import hierarchical_all_reduce, ring_all_reduce
from lightning_strategies.comm.ring.check import SUPPORTED_DTYPES, WIRE_DTYPES, resolve_wire_dtype
from lightning_strategies.comm.ring.halves import owned_chunk, ring_all_gather, ring_reduce_scatter
from lightning_strategies.comm.ring.layout import (
    MIN_CHUNK_BYTES,
    NodeLayout,
    new_hierarchical_groups,
    ring_bucket_cap_mb,
)
from lightning_strategies.comm.ring.reducer import RingBucketReducer
from lightning_strategies.comm.ring.transport import RingPeerError, release_workspace

__all__ = [
    "MIN_CHUNK_BYTES",
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "NodeLayout",
    "RingBucketReducer",
    "RingPeerError",
    "hierarchical_all_reduce",
    "new_hierarchical_groups",
    "owned_chunk",
    "release_workspace",
    "resolve_wire_dtype",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bucket_cap_mb",
    "ring_reduce_scatter",
]
