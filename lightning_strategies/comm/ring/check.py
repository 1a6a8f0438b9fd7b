"""The cross-rank input check: one small all-gather so that a bad or mismatched call raises on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SUPPORTED_DTYPES", "WIRE_DTYPES", "resolve_wire_dtype"]

#: Dtypes ``ring_all_reduce`` reduces: those gloo and NCCL both support for sum, minus bool
#: (whose "sum" is a logical or) and complex (reduce ``torch.view_as_real(t)`` instead).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)

#: Names accepted for ``wire_dtype`` (the strategy takes the short ones, from YAML).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

_OPS = ("sum", "avg")
# Codes exchanged by the peer check; -1 stands for "not in the list" (an unsupported dtype).
_DTYPE_CODES: tuple[torch.dtype, ...] = (*SUPPORTED_DTYPES, torch.bool, torch.complex64, torch.complex128)


def resolve_wire_dtype(wire_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Turn ``None`` / ``"bf16"`` / ``"fp16"`` / ``torch.bfloat16`` / ``torch.float16`` into a dtype.

    Raises:
        ValueError: for any other value, listing the accepted ones.
    """
    if wire_dtype is None:
        return None
    if isinstance(wire_dtype, torch.dtype):
        if wire_dtype in WIRE_DTYPES.values():
            return wire_dtype
    elif isinstance(wire_dtype, str) and wire_dtype.lower() in WIRE_DTYPES:
        return WIRE_DTYPES[wire_dtype.lower()]
    raise ValueError(
        f"Invalid wire_dtype {wire_dtype!r}: expected None (send in the tensor's own dtype) or one of "
        f"{sorted(WIRE_DTYPES)} / torch.bfloat16 / torch.float16."
    )


def _local_problem(tensor: Any, op: str, wire: torch.dtype | None) -> Exception | None:
    """Why this rank cannot take part (the exception, returned so the peers are told first), or None."""
    message = _problem_message(tensor, op, wire)
    if message is None:
        return None
    bad_type = not isinstance(tensor, torch.Tensor) or tensor.dtype not in SUPPORTED_DTYPES
    return (TypeError if bad_type else ValueError)(f"ring_all_reduce: {message}.")


def _problem_message(tensor: Any, op: str, wire: torch.dtype | None) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"expected a torch.Tensor, found {type(tensor).__name__}"
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        hint = " (reduce torch.view_as_real(tensor) instead)" if tensor.is_complex() else ""
        return f"unsupported dtype {tensor.dtype}{hint}; supported: {names}"
    if not tensor.is_contiguous():
        return (
            f"the tensor is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
            "the ring reduces the storage in place, so pass tensor.contiguous() and copy the result back"
        )
    if op not in _OPS:
        return f"invalid op {op!r}; expected one of {list(_OPS)}"
    if wire is not None and wire != tensor.dtype:
        if not tensor.is_floating_point():
            return f"wire_dtype={wire} needs a floating tensor, found {tensor.dtype}; pass wire_dtype=None"
        if wire.itemsize >= tensor.dtype.itemsize:
            return (
                f"wire_dtype={wire} is not narrower than the tensor's {tensor.dtype}; "
                "pass wire_dtype=None to send the tensor's own dtype"
            )
    return None


def _dtype_code(dtype: torch.dtype | None) -> int:
    if dtype is None:
        return -2
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1


def _dtype_name(code: int) -> str:
    return {-2: "None", -1: "unsupported"}.get(code) or str(_DTYPE_CODES[code]).removeprefix("torch.")


def _call_row(tensor: Any, problem: Exception | None, op: str, wire: torch.dtype | None) -> list[int]:
    """What the peer check exchanges: numel, dtype, op and wire dtype (must agree), then input ok."""
    ok = isinstance(tensor, torch.Tensor)
    return [
        tensor.numel() if ok else -1,
        _dtype_code(tensor.dtype) if ok else -1,
        _OPS.index(op) if op in _OPS else -1,
        _dtype_code(wire),
        int(problem is None),
    ]


def _gather_rows(tensor: Any, row: list[int], group: dist.ProcessGroup) -> list[list[int]]:
    ok = isinstance(tensor, torch.Tensor)
    device = tensor.device if ok and tensor.device.type != "meta" else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size(group)
    rows = [torch.empty(len(row), dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(row, dtype=torch.int64, device=device), group=group)
    return [r.cpu().tolist() for r in rows]


def _verdict(table: list[list[int]], group: dist.ProcessGroup, who: str = "") -> ValueError | None:
    """The error every rank raises when some rank rejected its input or the ranks disagree, else None."""
    rank = dist.get_global_rank(group, dist.get_rank(group))
    ranks = [dist.get_global_rank(group, r) for r in range(len(table))]
    bad = [ranks[r] for r, row in enumerate(table) if row[4] == 0]
    if bad:
        return ValueError(
            f"ring_all_reduce: rank(s) {bad} rejected their input{who} (see their error); "
            f"rank {rank} stops too so that no rank waits for messages that will never come."
        )
    if any(row[:4] != table[0][:4] for row in table):
        desc = "; ".join(
            f"rank {ranks[r]}: numel={row[0]} dtype={_dtype_name(row[1])} op={_OPS[row[2]]} "
            f"wire_dtype={_dtype_name(row[3])}"
            for r, row in enumerate(table)
        )
        return ValueError(
            f"ring_all_reduce: ranks disagree on the call ({desc}). Every rank must pass a tensor of "
            "the same numel and dtype with the same op and wire_dtype."
        )
    return None


def _validated(
    tensor: Any, op: str, wire_dtype: str | torch.dtype | None, groups: Sequence[dist.ProcessGroup] = ()
) -> torch.dtype | None:
    """The wire dtype, once this rank's input is checked and, over ``groups`` (none: this rank alone), the peers'.

    One all-gather of a few integers per group, so that a bad or mismatched call raises on *every* rank: otherwise
    a mismatched rank waits for the process-group timeout, or a bad input raises on one rank alone. The hierarchical
    ring checks inside the node, then across (no group spans the world): the node's verdict travels across as this
    rank's "input ok", so every rank raises and none waits.
    """
    problem: Exception | None
    try:
        wire = resolve_wire_dtype(wire_dtype)
    except ValueError as exc:  # told to the peers like any other bad input
        wire, problem = None, exc
    else:
        problem = _local_problem(tensor, op, wire)
    row = _call_row(tensor, problem, op, wire)
    for i, group in enumerate(groups):
        table = _gather_rows(tensor, [*row[:4], int(problem is None)], group)
        if problem is None:
            problem = _verdict(table, group, " (or a process on their node did)" if i else "")
    if problem is not None:
        raise problem
    return wire
