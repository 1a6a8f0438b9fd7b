"""The optimizer state of :class:`~lightning_strategies.comm.ps.ring_shards.RingShards` in the worker
optimizer's format (no Lightning import): gathered for a checkpoint, sliced back on resume.

Each bucket's optimizer holds state for its pieces (chunks of tensors). A per-element state (momentum, Adam's
moments) is laid out in a flat buffer like the bucket's values and all-gathered with comm.ring's all-gather,
so every tensor's state comes back whole; a per-tensor scalar (Adam's ``step``) is the same on every piece of a
tensor (every piece steps every step) and is taken from whichever rank holds one. The result loads into the
user's optimizer on one device, as DDP's checkpoint does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_strategies.comm.ps.ring_shards import RingBucket, RingShards

__all__ = ["gather_ring_state", "load_ring_state"]


def _piece_states(bucket: RingBucket) -> list[dict[str, Any]]:
    if bucket.optimizer is None:
        return [{} for _ in bucket.pieces]
    state = bucket.optimizer.state
    return [dict(state.get(p, {})) for p in bucket.piece_params]


def _is_elementwise(value: Any, n: int) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == n


def gather_ring_state(shards: RingShards, param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole optimizer state in the worker optimizer's ``state_dict`` format, on every rank (a collective of
    the shards' groups and the default one: every rank calls it, on the main thread, between steps).

    Args:
        shards: this rank's shards.
        param_groups: the worker optimizer's ``state_dict()["param_groups"]`` (its options and tensor indices).
    """
    local: dict[int, dict[str, Any]] = {}  # flat index -> per-tensor scalars held here
    keys: set[str] = set()  # per-element keys held here
    for bucket in shards.buckets:
        for (i, a, b, _), st in zip(bucket.pieces, _piece_states(bucket), strict=True):
            for k, v in st.items():
                if _is_elementwise(v, b - a):
                    keys.add(k)
                else:
                    local.setdefault(i, {})[k] = v.clone() if isinstance(v, Tensor) else v
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(keys), local))  # the default group: this runs between steps
    all_keys = sorted({k for held, _ in everyone for k in held})
    state: dict[int, dict[str, Any]] = {}
    for _, scalars in everyone:
        for i, st in scalars.items():
            state.setdefault(i, {}).update(st)
    for bucket in shards.buckets:
        states = _piece_states(bucket)
        for key in all_keys:
            flat = torch.zeros_like(bucket.values)
            for (_, a, b, _), st in zip(bucket.pieces, states, strict=True):
                if key in st:
                    flat[a:b].copy_(st[key])
            shards.all_gather(flat)
            for i, off in zip(bucket.tensors, bucket.offsets, strict=True):
                p = shards.params[i]
                state.setdefault(i, {})[key] = flat[off : off + p.numel()].view_as(p).clone()
    return {"state": {i: state[i] for i in sorted(state) if state[i]}, "param_groups": [dict(g) for g in param_groups]}


def load_ring_state(shards: RingShards, full: Mapping[str, Any]) -> None:
    """Load each bucket's pieces of ``full`` (a whole optimizer ``state_dict`` in the worker optimizer's format:
    this strategy's checkpoint, DDP's or a single device's). No collective.

    Raises:
        ValueError: a per-element state whose size is not its tensor's.
    """
    states: Mapping[int, Mapping[str, Any]] = full.get("state", {})
    for bucket in shards.buckets:
        if bucket.optimizer is None:
            continue
        piece_state: dict[int, dict[str, Any]] = {}
        for k, (i, a, b, off) in enumerate(bucket.pieces):
            saved = states.get(i)
            if not saved:
                continue
            n = shards.params[i].numel()
            st: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    if value.numel() != n:
                        raise ValueError(
                            f"ps_ring: the checkpoint's optimizer state {key!r} of tensor {i} has {value.numel()} "
                            f"elements: expected {n}, the tensor's. Fix: resume from a checkpoint of this model."
                        )
                    st[key] = value.reshape(-1)[a - off : b - off].clone()
                else:
                    st[key] = value.clone() if isinstance(value, Tensor) else value
            piece_state[k] = st
        own = bucket.optimizer.state_dict()
        bucket.optimizer.load_state_dict({"state": piece_state, "param_groups": own["param_groups"]})
