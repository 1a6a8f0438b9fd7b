"""A pipeline's stages held apart: each rank materialises only the blocks of its own stages.

The other ranks' blocks stay on ``meta`` (shape and dtype, no storage), so their parameters, gradients and
optimizer state never exist there. A block built on ``meta`` is initialised on rank 0's CPU in block order,
from rank 0's CPU RNG: the weights of an unsplit model built on CPU after the same seed. Checkpoints gather
the whole state on rank 0, streamed into memory-mapped temporary files (:class:`Spill`).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "Spill",
    "StageLayout",
    "distribute_blocks",
    "gather_optimizer_state",
    "gather_state_dict",
    "held_bytes",
    "initialize",
    "is_materialized",
    "materialize",
    "move_blocks",
    "move_to",
    "profile_stages",
    "tensors_of",
    "to_meta",
]


@dataclass(frozen=True)
class StageLayout:
    """Blocks per stage and the pipeline rank of each stage (stage ``s`` on rank ``s % ranks``).

    Args:
        counts: blocks of each stage, in order (``S`` entries).
        ranks: pipeline ranks; ``S`` must be a multiple (``S / ranks`` stages per rank).
    """

    counts: tuple[int, ...]
    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1 or not self.counts or len(self.counts) % self.ranks or min(self.counts) < 1:
            raise ValueError(
                f"StageLayout(counts={list(self.counts)}, ranks={self.ranks}): expected a positive block count per "
                "stage and a number of stages that is a multiple of the pipeline ranks."
            )

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @property
    def bounds(self) -> list[int]:
        """Index of each stage's first block, and the number of blocks at the end."""
        return [0, *accumulate(self.counts)]

    def blocks(self, stage: int) -> range:
        """The block indices of ``stage``."""
        b = self.bounds
        return range(b[stage], b[stage + 1])

    def owner(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.ranks))

    def owner_of_block(self, block: int) -> int:
        b = self.bounds
        for stage in range(self.num_stages):
            if b[stage] <= block < b[stage + 1]:
                return self.owner(stage)
        raise IndexError(f"block {block} is not in the {b[-1]} blocks of this layout")

    def blocks_of(self, rank: int) -> list[int]:
        """The block indices ``rank`` holds, in order."""
        return [i for s in self.stages_of(rank) for i in self.blocks(s)]


_Slot = tuple[nn.Module, str, bool, Tensor]  # (module owning the tensor, its attribute name, is a parameter, it)


def _slots(module: nn.Module) -> list[_Slot]:
    out: list[_Slot] = []
    for m in module.modules():
        out += [(m, name, True, p) for name, p in m._parameters.items() if p is not None]
        out += [(m, name, False, b) for name, b in m._buffers.items() if b is not None]
    return out


def tensors_of(module: nn.Module) -> list[Tensor]:
    """``module``'s parameters and buffers, each once, in the order every rank sends and receives them."""
    return list({id(t): t for *_, t in _slots(module)}.values())


def is_materialized(module: nn.Module) -> bool:
    """Whether none of ``module``'s parameters and buffers is on the ``meta`` device."""
    return not any(t.is_meta for t in tensors_of(module))


def _replace(module: nn.Module, make: Callable[[Tensor], Tensor | None]) -> list[tuple[Tensor, Tensor]]:
    """Give every tensor slot ``make(old)`` (kept when ``None``), tied slots staying tied; return ``(old, new)``
    for every replaced parameter (optimizers hold parameters by identity: the caller swaps them there)."""
    memo: dict[int, Tensor] = {}
    replaced: list[tuple[Tensor, Tensor]] = []
    for m, name, is_param, old in _slots(module):
        if id(old) not in memo:
            made = make(old)
            if made is None:
                memo[id(old)] = old
                continue
            new: Tensor = nn.Parameter(made, requires_grad=old.requires_grad) if is_param else made
            memo[id(old)] = new
            if is_param:
                replaced.append((old, new))
        new = memo[id(old)]
        if new is old:
            continue
        if is_param:
            m._parameters[name] = new  # type: ignore[assignment]
        else:
            m._buffers[name] = new
    return replaced


def to_meta(module: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Replace ``module``'s tensors by ``meta`` placeholders of the same shape and dtype (freeing them)."""
    return _replace(module, lambda t: None if t.is_meta else torch.empty_like(t, device="meta"))


def materialize(module: nn.Module, device: torch.device, *, fresh: bool = False) -> list[tuple[Tensor, Tensor]]:
    """Give ``module``'s ``meta`` tensors (with ``fresh``, all of them) uninitialised storage on ``device``."""
    return _replace(module, lambda t: torch.empty_like(t, device=device) if fresh or t.is_meta else None)


def move_to(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s non-``meta`` tensors to ``device`` (``module.to`` cannot copy ``meta`` ones)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def initialize(module: nn.Module) -> None:
    """``reset_parameters()`` of every submodule that owns tensors, in ``module.modules()`` order.

    Raises:
        ValueError: naming a submodule with tensors of its own but no ``reset_parameters``.
    """
    for name, m in module.named_modules():
        own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        if not own:
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"found {type(m).__name__} ({name or 'the block itself'}) built on the meta device with tensors of its "
                "own and no reset_parameters(): expected every module that owns parameters or buffers to say how "
                "they start, since the pipeline initialises blocks built on meta by calling it. Fix: give it a "
                "reset_parameters() method, or build the module with values (e.g. in __init__)."
            )
        with torch.no_grad():
            reset()


def held_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the tensors that have storage here (``meta`` and ``None`` count zero), each once."""
    held = {id(t): t for t in tensors if t is not None and not t.is_meta}
    return sum(t.numel() * t.element_size() for t in held.values())


def distribute_blocks(
    blocks: nn.Sequential,
    layout: StageLayout,
    *,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
    init_device: torch.device | None = None,
) -> None:
    """Every rank ends with its stages' blocks on ``device`` holding global rank 0's values, the others
    on ``meta`` (a collective over the world).

    Rank 0 materialises and :func:`initialize`-s a block built on ``meta`` on ``init_device`` (default the
    CPU) and sends it to its owner; the other replicas' owners receive it over ``dp_group``. Tensors travel
    on ``device`` (NCCL has no CPU backend).

    Raises:
        ValueError: from :func:`initialize`, for a meta block rank 0 cannot initialise.
    """
    pp_rank = dist.get_rank(pp_group)
    replica = dist.get_rank(dp_group) if dp_group is not None else 0
    for stage in range(layout.num_stages):
        owner = layout.owner(stage)
        for i in layout.blocks(stage):
            block = blocks[i]
            if pp_rank != owner and not (replica == 0 and pp_rank == 0):
                to_meta(block)
            elif replica != 0:
                materialize(block, device, fresh=True)  # filled by the broadcast below
            elif pp_rank == 0:
                if not is_materialized(block):
                    materialize(block, init_device or torch.device("cpu"))
                    initialize(block)
                if owner == 0:
                    move_to(block, device)
                else:
                    for t in tensors_of(block):
                        dist.send(t.detach().to(device).contiguous(), group=pp_group, group_dst=owner)
                    to_meta(block)
            else:  # the owner in replica 0
                materialize(block, device, fresh=True)
                with torch.no_grad():
                    for t in tensors_of(block):
                        dist.recv(t, group=pp_group, group_src=0)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        with torch.no_grad():
            for i in layout.blocks_of(pp_rank):
                for t in tensors_of(blocks[i]):
                    dist.broadcast(t, group=dp_group, group_src=0)


def _send_with_meta(tensor: Tensor, dst: int, group: dist.ProcessGroup, device: torch.device) -> None:
    dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], group=group, device=device, group_dst=dst)
    dist.send(tensor.contiguous(), group=group, group_dst=dst)


def _recv_with_meta(src: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, device=device, group_src=src)
    shape, dtype = box[0]
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=src)
    return out


def profile_stages(
    blocks: nn.Sequential,
    layout: StageLayout,
    sample: Tensor | None,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    profile: Callable[[nn.Sequential, Tensor], tuple[list[float], Tensor]],
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
) -> Tensor:
    """Each block's forward + backward seconds, measured by the rank that holds it (a collective).

    The sample (given on stage 0's rank) flows through the stages as in a forward pass, each owner timing its
    blocks with ``profile``. Returns every block's seconds, float64 on ``device``, alike on every rank.
    """
    rank = dist.get_rank(group)
    seconds = torch.zeros(len(blocks), dtype=torch.float64, device=device)
    x = sample
    for stage in range(layout.num_stages):
        if layout.owner(stage) != rank:
            continue
        if stage > 0 and layout.owner(stage - 1) != rank:
            x = _recv_with_meta(layout.owner(stage - 1), group, device)
        assert x is not None, "the rank holding stage 0 gives the sample"
        span = layout.blocks(stage)
        with autocast() if autocast is not None else nullcontext():
            measured, x = profile(nn.Sequential(*blocks[span.start : span.stop]), x)
        seconds[span.start : span.stop] = torch.tensor(measured, dtype=torch.float64, device=device)
        if stage + 1 < layout.num_stages and layout.owner(stage + 1) != rank:
            _send_with_meta(x, layout.owner(stage + 1), group, device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(seconds, group=group)  # each block measured by one rank: the sum is its time
    return seconds


def move_blocks(
    blocks: nn.Sequential,
    old: StageLayout,
    new: StageLayout,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    optimizers: Sequence[Optimizer] = (),
) -> None:
    """Move every block whose owner differs between ``old`` and ``new`` to its new owner (a collective),
    with its optimizers' state; each optimizer's parameter lists then hold the new parameter objects."""
    rank = dist.get_rank(group)
    for i, block in enumerate(blocks):
        a, b = old.owner_of_block(i), new.owner_of_block(i)
        if a == b or rank not in (a, b):
            continue
        params = [t for t in tensors_of(block) if isinstance(t, nn.Parameter)]
        if rank == a:
            for t in tensors_of(block):
                dist.send(t.detach().to(device).contiguous(), group=group, group_dst=b)
            pairs = to_meta(block)
            states = [[_cpu(opt.state.pop(p, {})) for p in params] for opt in optimizers]
            dist.send_object_list([states], group=group, device=device, group_dst=b)
        else:
            pairs = materialize(block, device, fresh=True)
            with torch.no_grad():
                for t in tensors_of(block):
                    dist.recv(t, group=group, group_src=a)
            box: list[Any] = [None]
            dist.recv_object_list(box, group=group, device=device, group_src=a)
            by_old = dict((id(o), n) for o, n in pairs)
            for opt, opt_states in zip(optimizers, box[0], strict=True):
                for p, state in zip(params, opt_states, strict=True):
                    if state:
                        opt.state[by_old[id(p)]] = {
                            k: v.to(device) if isinstance(v, Tensor) and k != "step" else v for k, v in state.items()
                        }
        swap = {id(o): n for o, n in pairs}
        for opt in optimizers:
            for group_ in opt.param_groups:
                group_["params"] = [swap.get(id(p), p) for p in group_["params"]]


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


class Spill:
    """Tensors written to temporary files as they arrive and read back memory-mapped.

    Rank 0 of a checkpoint gather holds at most ``chunk_bytes`` of received tensors in memory: each full
    chunk is saved, loaded back with ``mmap=True`` and unlinked, leaving file-backed pages the kernel can drop.

    Args:
        directory: where the chunk files go (default ``TMPDIR``; needs room for the whole gathered state).
        chunk_bytes: bytes collected before a chunk is written (a larger tensor is a chunk alone).
    """

    def __init__(self, directory: str | None = None, chunk_bytes: int = 16 << 20) -> None:
        self._directory = directory
        self._chunk_bytes = chunk_bytes
        self._pending: dict[int, Tensor] = {}
        self._bytes = 0
        self.tensors: dict[int, Tensor] = {}

    def add(self, key: int, tensor: Tensor) -> None:
        """Keep ``tensor`` (a snapshot: a device tensor is copied to the host) under ``key``."""
        value = tensor.detach().cpu()  # no copy of a CPU tensor
        self._pending[key] = value
        self._bytes += value.numel() * value.element_size()
        if self._bytes >= self._chunk_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        fd, path = tempfile.mkstemp(prefix=".pipeline-spill-", suffix=".pt", dir=self._directory)
        os.close(fd)
        try:
            torch.save(self._pending, path)
            # MAP_SHARED: the pages are the page cache's (reclaimable, not the process's private
            # memory); the file is ours, unlinked below, so nothing else sees a write through them.
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                self.tensors.update(torch.load(path, mmap=True, weights_only=True, map_location="cpu"))
        finally:
            os.unlink(path)  # the mapping stays valid; the space goes with the last tensor
        self._pending, self._bytes = {}, 0

    def finish(self) -> dict[int, Tensor]:
        """Write what is pending; every tensor added, memory-mapped, by key."""
        self._flush()
        return self.tensors


def gather_state_dict(
    state: dict[str, Any],
    owners: dict[str, int],
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    spill_dir: str | None = None,
) -> dict[str, Any]:
    """The whole state dict on group rank 0 (memory-mapped CPU tensors), ``{}`` elsewhere (a collective).

    Args:
        state: this rank's ``module.state_dict()``, other ranks' tensors ``meta`` (shape and dtype to receive).
        owners: the group rank holding each key's tensor (0 for what every rank holds alike).
        device: where point-to-point tensors travel (the group's device).
        spill_dir: :class:`Spill`'s directory.
    """
    rank = dist.get_rank(group)
    spill = Spill(spill_dir) if rank == 0 else None
    for i, (key, value) in enumerate(state.items()):
        owner = owners.get(key, 0)
        if not isinstance(value, Tensor):
            continue
        if rank == 0:
            assert spill is not None
            if owner == 0:
                spill.add(i, value)
            else:
                buffer = torch.empty(value.shape, dtype=value.dtype, device=device)
                dist.recv(buffer, group=group, group_src=owner)
                spill.add(i, buffer)
        elif rank == owner:
            dist.send(value.detach().to(device).contiguous(), group=group, group_dst=0)
    if spill is None:
        return {}
    tensors = spill.finish()
    return {key: tensors[i] if isinstance(value, Tensor) else value for i, (key, value) in enumerate(state.items())}


def _describe(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """An optimizer state's structure: ``("tensor", shape, dtype)`` per tensor, other values as they are."""
    return {
        index: {
            key: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, Tensor) else ("value", v)
            for key, v in entry.items()
        }
        for index, entry in state.items()
    }


def gather_optimizer_state(
    state_dict: dict[str, Any],
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    spill_dir: str | None = None,
) -> dict[str, Any]:
    """The optimizer state of every stage on group rank 0 (memory-mapped CPU tensors), ``{}`` elsewhere.

    Each rank's ``optimizer.state_dict()`` indexes every parameter of the module (placeholders included)
    and holds state for its own stages' only. The result loads into the unsplit module's optimizer.
    """
    rank = dist.get_rank(group)
    mine = state_dict["state"]
    parts: list[Any] = [None] * dist.get_world_size(group) if rank == 0 else []
    dist.gather_object(_describe(mine), parts if rank == 0 else None, group=group, group_dst=0)
    if rank != 0:
        for index in sorted(mine):
            for value in mine[index].values():
                if isinstance(value, Tensor):
                    dist.send(value.detach().to(device).contiguous(), group=group, group_dst=0)
        return {}
    where = {index: (owner, entry) for owner, part in enumerate(parts) for index, entry in part.items()}
    spill = Spill(spill_dir)
    slots: list[tuple[int, str]] = []
    merged: dict[int, dict[str, Any]] = {}
    for index in sorted(where):
        owner, entry = where[index]
        merged[index] = {}
        for key, spec in entry.items():
            if spec[0] == "value":
                merged[index][key] = spec[1]
                continue
            if owner == 0:
                spill.add(len(slots), mine[index][key])
            else:
                _, shape, dtype = spec
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, group=group, group_src=owner)
                spill.add(len(slots), buffer)
            slots.append((index, key))
    tensors = spill.finish()
    for n, (index, key) in enumerate(slots):
        merged[index][key] = tensors[n]
    # the entries of each index in the order the optimizer wrote them
    ordered = {index: {key: merged[index][key] for key in where[index][1]} for index in merged}
    return {"state": ordered, "param_groups": state_dict["param_groups"]}
