"""The wire format: a shard's tensors as one flat tensor per dtype, and their payload bytes.

A worker's ``bytes_sent`` are the gradients it pushed, ``bytes_received`` the values it pulled (a
shard's the reverse); calls to the co-located shard, made without RPC, count too: the counts measure
the algorithm, not the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_strategies.comm.ps.plan import Slice

__all__ = ["Packed", "pack", "payload_bytes", "slice_of", "unpack", "write_slice"]


def payload_bytes(tensors: Sequence[Tensor | None]) -> int:
    """Bytes of the tensors' data (``None`` counts nothing): what the byte counts measure."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def slice_of(tensor: Tensor, sl: Slice) -> Tensor:
    """The elements of ``sl`` in ``tensor`` (detached): the tensor itself when whole, else flat (a view
    when ``tensor`` is contiguous, else a copy)."""
    t = tensor.detach()
    if sl.start == 0 and sl.stop == t.numel():
        return t
    return t.reshape(-1)[sl.start : sl.stop]


@dataclass
class Packed:
    """Tensors sent as one flat tensor per dtype: one payload per shard and step, not one per tensor.

    Attributes:
        flats: the tensors present, concatenated per dtype (in order of first appearance); fresh
            memory, so a later update cannot change them.
        present: which tensors were sent (``None``: all); a tensor unused in a step has no gradient.
    """

    flats: list[Tensor]
    present: list[bool] | None = None

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.flats)


def pack(tensors: Sequence[Tensor | None]) -> Packed:
    """``tensors`` as one :class:`Packed` payload (a copy); :func:`unpack` reverses it."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        if t is not None:
            by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    present = [t is not None for t in tensors]
    return Packed([torch.cat(ts) for ts in by_dtype.values()], None if all(present) else present)


def unpack(packed: Packed, like: Sequence[Tensor]) -> list[Tensor | None]:
    """The tensors of ``packed``, shaped like ``like`` (views into the payload; ``None`` where absent).

    Raises:
        ValueError: when the payload does not fit ``like`` (count, dtypes or sizes).
    """
    present = packed.present if packed.present is not None else [True] * len(like)
    if len(present) != len(like):
        raise ValueError(f"a payload of {len(present)} tensors, expected {len(like)}")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(like):
        if present[k]:
            by_dtype.setdefault(t.dtype, []).append(k)
    if len(by_dtype) != len(packed.flats) or any(
        f.dtype != d or f.numel() != sum(like[k].numel() for k in ks)
        for f, (d, ks) in zip(packed.flats, by_dtype.items(), strict=False)
    ):
        raise ValueError(
            f"a payload of {[(f.dtype, f.numel()) for f in packed.flats]} (dtype, elements), expected "
            f"{[(d, sum(like[k].numel() for k in ks)) for d, ks in by_dtype.items()]}"
        )
    out: list[Tensor | None] = [None] * len(like)
    for flat, ks in zip(packed.flats, by_dtype.values(), strict=True):
        offset = 0
        for k in ks:
            n = like[k].numel()
            out[k] = flat[offset : offset + n].view(like[k].shape)
            offset += n
    return out


def write_slice(param: Tensor, sl: Slice, value: Tensor) -> None:
    """``param``'s elements of ``sl`` = ``value`` (in place, under ``no_grad``)."""
    t = param.detach()
    if sl.start == 0 and sl.stop == t.numel():
        t.copy_(value.view(t.shape))
    elif t.is_contiguous():
        t.view(-1)[sl.start : sl.stop].copy_(value)
    else:  # e.g. channels_last: no flat view; write through a flat copy
        flat = t.reshape(-1).clone()
        flat[sl.start : sl.stop] = value
        t.copy_(flat.view(t.shape))
