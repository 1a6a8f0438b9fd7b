"""The pipeline's model split over its ranks: the stages, each rank's blocks, checkpoints of a split model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.comm.pipeline import SCHEDULES, partition_blocks, profile_blocks_with_output
from lightning_strategies.comm.pipeline_stages import (
    StageLayout,
    distribute_blocks,
    gather_optimizer_state,
    gather_state_dict,
    move_blocks,
    move_to,
    profile_stages,
    tensors_of,
)
from lightning_strategies.pipeline_protocol import check_pipeline_module
from lightning_strategies.strategies._base import exposed, optimizer_state_unsplit, unwrap_optimizer
from lightning_strategies.strategies._model_parallel import ModelParallelStrategy

__all__ = [
    "BALANCES",
    "LAYOUT_KEY",
    "Balance",
    "PipelineSplit",
    "check_balance",
    "check_schedule",
    "instance_attribute",
    "no_state_broadcast",
    "placeholders_stay",
]

BALANCES: tuple[str, ...] = ("params", "time")

#: Where a split module records its layout (a module split once keeps its split across trainer calls).
LAYOUT_KEY = "_pipeline_layout"

Balance = str | Sequence[int]


class PipelineSplit(ModelParallelStrategy):
    """A model's blocks split into stages over the pipeline ranks, and the state of such a model."""

    _balance: Balance
    _stages_per_rank: int
    _layout: StageLayout | None
    _model_at_fit_end: dict[str, Any] | None
    _schedule: str
    _microbatches: int | None
    _profiled: bool
    _blocks: nn.Sequential | None

    stages_per_rank: int = exposed("_stages_per_rank", "Stages each rank holds (more than one interleaved).")
    layout: StageLayout | None = exposed(
        "_layout", "Blocks per stage and the rank of each stage (``None`` until setup)."
    )

    @property
    def num_stages(self) -> int:
        """Pipeline ranks: the ``num_stages`` option, or the world size."""
        return self.model_parallel_size

    def _holds_last_stage(self) -> bool:
        layout, pp_group = self._layout, self._group("pp")
        assert layout is not None and pp_group is not None
        return layout.owner(layout.num_stages - 1) == dist.get_rank(pp_group)

    @override
    def on_train_end(self) -> None:
        # the stages' groups go at teardown: gather the state now (save_checkpoint after fit, a spawned fit's caller)
        self._model_at_fit_end = self.lightning_module_state_dict()
        super().on_train_end()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # After the split: each rank copies its own stages' tensors from the (memory-mapped) file.
        return True

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``configure_model`` and ``Trainer.init_module()`` build on ``meta`` (unless ``empty_init=False``):
        a model too large for one process is materialised block by block at setup."""
        device = torch.device("meta") if empty_init is not False else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        """Decide the stages, give each rank its blocks (rank 0's weights); a module split already keeps its split."""
        module = self.lightning_module
        pp_group = self._group("pp")
        assert module is not None and pp_group is not None
        blocks = self._layers(module)
        recorded = module.__dict__.get(LAYOUT_KEY)
        if isinstance(recorded, StageLayout):
            if recorded.ranks != self.num_stages or recorded.num_stages != self.num_stages * self._stages_per_rank:
                raise ValueError(
                    f"PipelineStrategy found {type(module).__name__} split already over {recorded.ranks} pipeline "
                    f"ranks ({list(recorded.counts)} blocks per stage): expected {self.num_stages} ranks x "
                    f"{self._stages_per_rank} stages. Fix: load the checkpoint into a fresh module, or keep "
                    "the split it was trained with."
                )
            self._layout = recorded
            move_to(module, self.root_device)
            return
        layout = self._initial_layout(blocks)
        self._check_split(module, blocks, layout)
        distribute_blocks(blocks, layout, pp_group=pp_group, dp_group=self._group("dp"), device=self.root_device)
        move_to(module, self.root_device)  # what lies outside the blocks: every rank holds it
        self._sync_rest(module, blocks)
        module.__dict__[LAYOUT_KEY] = self._layout = layout

    def _initial_layout(self, blocks: nn.Sequential) -> StageLayout:
        self._check_blocks(len(blocks))
        total = self.num_stages * self._stages_per_rank
        if isinstance(self._balance, str):  # "params", and "time" until its first batch is measured
            counts = partition_blocks([sum(p.numel() for p in b.parameters()) for b in blocks], total)
        else:
            counts = list(self._balance)
        rank_zero_info(f"{type(self).__name__}: blocks per stage {counts}")
        return StageLayout(tuple(counts), self.num_stages)

    @staticmethod
    def _check_split(module: nn.Module, blocks: nn.Sequential, layout: StageLayout) -> None:
        """Refuse a tensor shared by blocks on different ranks, and tensors outside the blocks on ``meta``."""
        where: dict[int, int] = {}
        for i, block in enumerate(blocks):
            for t in tensors_of(block):
                j = where.setdefault(id(t), i)
                if layout.owner_of_block(j) != layout.owner_of_block(i):
                    raise ValueError(
                        f"PipelineStrategy found a tensor shared by blocks {j} and {i} of pipeline_layers(), which "
                        f"go to different ranks ({list(layout.counts)} blocks per stage): expected each parameter "
                        "in one stage, since a rank holds only its own stages. Fix: untie the weights, or pass "
                        "balance=[...] so that both blocks land in one stage."
                    )
        in_blocks = {id(t) for b in blocks for t in tensors_of(b)}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) not in in_blocks and t.is_meta:
                raise ValueError(
                    f"PipelineStrategy found {name} outside pipeline_layers() on the meta device: expected the "
                    "tensors outside the blocks to hold values, since every rank keeps them whole. Fix: build "
                    "them outside the meta context (e.g. in __init__), or move them into a block."
                )

    def _sync_rest(self, module: nn.Module, blocks: nn.Sequential) -> None:
        """Rank 0's values of the tensors outside the blocks on every rank (as DDP's constructor does)."""
        in_blocks = {id(t) for b in blocks for t in tensors_of(b)}
        rest = [t for t in tensors_of(module) if id(t) not in in_blocks]
        if self.world_size > 1:
            with torch.no_grad():
                for t in rest:
                    dist.broadcast(t, src=0)

    @staticmethod
    def _layers(module: Any) -> nn.Sequential:
        check_pipeline_module(module)
        blocks = module.pipeline_layers()
        if not isinstance(blocks, nn.Sequential):
            raise TypeError(
                f"{type(module).__name__}.pipeline_layers() returned a {type(blocks).__name__}: expected a "
                "torch.nn.Sequential of blocks. Fix: return nn.Sequential(block_1, ..., block_n)."
            )
        return blocks

    def _check_blocks(self, n_blocks: int) -> None:
        total = self.num_stages * self._stages_per_rank
        if total > n_blocks:
            raise ValueError(
                f"PipelineStrategy: {total} stages ({self.num_stages} ranks x {self._stages_per_rank} "
                f"stages per rank) but pipeline_layers() has only {n_blocks} blocks: every stage needs at "
                f"least one. Fix: use at most {n_blocks} stages, or split the model into more blocks."
            )
        if not isinstance(self._balance, str):
            counts = list(self._balance)
            if len(counts) != total or sum(counts) != n_blocks:
                raise ValueError(
                    f"PipelineStrategy(balance={counts}): expected {total} block counts (one per stage) "
                    f"adding up to the {n_blocks} blocks of pipeline_layers(), found {len(counts)} adding "
                    f"up to {sum(counts)}. Fix: give one count per stage, or balance='params'/'time'."
                )

    def _gathers(self) -> dist.ProcessGroup | None:
        """The pipeline group when the state must be gathered from the stages (``None``: it is all here)."""
        pp_group = self._group("pp")
        if pp_group is None or self._layout is None or dist.get_world_size(pp_group) == 1:
            return None
        return pp_group

    def _owners(self, module: nn.Module) -> dict[str, int]:
        """The pipeline rank holding each state-dict key (0 for what lies outside the blocks)."""
        assert self._layout is not None
        rank_of: dict[int, int] = {}
        for i, block in enumerate(self._layers(module)):
            for t in tensors_of(block):
                rank_of[id(t)] = self._layout.owner_of_block(i)
        return {key: rank_of.get(id(value), 0) for key, value in module.state_dict(keep_vars=True).items()}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model on global rank 0 (``{}`` elsewhere), streamed from replica 0's stages."""
        module = self._module
        if self._mesh is None and self._model_at_fit_end is not None:
            return self._model_at_fit_end
        pp_group = self._gathers()
        if pp_group is None:
            return module.state_dict()
        if self._replica_rank() != 0:
            return {}  # replicas hold the same weights as replica 0, which is what is saved
        state = module.state_dict(keep_vars=True)
        return gather_state_dict(state, self._owners(module), group=pp_group, device=self.root_device)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full optimizer state on global rank 0 (``{}`` elsewhere), indexed as over the whole module."""
        optimizer = unwrap_optimizer(optimizer)
        if self._mesh is None:
            return optimizer_state_unsplit(self, optimizer)
        pp_group = self._gathers()
        if pp_group is None:
            return optimizer.state_dict()
        if self._replica_rank() != 0:
            return {}
        return gather_optimizer_state(optimizer.state_dict(), group=pp_group, device=self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, memory-mapped when it is a local file in torch's format."""
        path = os.fspath(checkpoint_path) if isinstance(checkpoint_path, str | os.PathLike) else None
        if path is not None and os.path.isfile(path) and isinstance(self.checkpoint_io, TorchCheckpointIO):
            with suppress(Exception):  # not a zip archive, an old format: the IO's own load and its diagnosis
                return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy this rank's stages' tensors (and those outside the blocks), checking the rest's keys and shapes."""
        module = self._module
        state = checkpoint["state_dict"]
        own = module.state_dict(keep_vars=True)
        placeholders = {k for k, v in own.items() if isinstance(v, Tensor) and v.is_meta}
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        reshaped = [
            f"{k}: {tuple(state[k].shape)} in the checkpoint, {tuple(own[k].shape)} here"
            for k in placeholders
            if k in state and isinstance(state[k], Tensor) and state[k].shape != own[k].shape
        ]
        if reshaped or (strict and (missing or unexpected)):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
                f"unexpected keys {unexpected[:5]}, size mismatch {reshaped[:5]}. Expected the tensors of the "
                "module this run builds. Fix: resume with the model settings the checkpoint was trained with."
            )
        module.load_state_dict({k: v for k, v in state.items() if k not in placeholders}, strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # the file holds every stage's state, indexed over the whole module: load this rank's parameters' only
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            opt = unwrap_optimizer(optimizer)
            params = [p for group in opt.param_groups for p in group["params"]]
            state = {i: entry for i, entry in saved["state"].items() if i < len(params) and not params[i].is_meta}
            optimizer.load_state_dict({**saved, "state": state})
            _optimizer_to_device(optimizer, self.root_device)

    @property
    def microbatches(self) -> int:
        """Micro-batches per batch: the option, or ``4 x num_stages``."""
        return self._microbatches if self._microbatches is not None else 4 * self.num_stages

    @override
    def _check_world(self) -> None:
        super()._check_world()
        stages = self.num_stages
        total = stages * self._stages_per_rank
        m = self.microbatches
        if self._schedule == "1f1b" and m < stages:
            raise ValueError(
                f"PipelineStrategy(schedule='1f1b', microbatches={m}) with {stages} stages: 1F1B needs at "
                f"least as many micro-batches as stages. Fix: pass microbatches >= {stages}, or schedule='gpipe'."
            )
        if self._schedule == "interleaved_1f1b":
            rounds = max(1, m // stages)
            if m % rounds:
                raise ValueError(
                    f"PipelineStrategy(schedule='interleaved_1f1b', microbatches={m}) with {stages} pipeline "
                    f"ranks: the micro-batches must be a multiple of the rounds max(1, {m} // {stages}) = "
                    f"{rounds}. Fix: pass microbatches a multiple of {stages}."
                )
        if m < total:
            rank_zero_warn(
                f"PipelineStrategy: {m} micro-batches for {total} stages: each stage idles for at least "
                f"{total - 1} of every {m + total - 1} slots of a step. Pass microbatches >= {total} "
                f"(4 x stages is a good start) for a smaller bubble.",
                category=UserWarning,
            )

    def _check_batch_size(self, size: int) -> None:
        m, r = self.microbatches, self.replicas
        if size % m:
            raise ValueError(
                f"PipelineStrategy: global batch {size * r} is not divisible by {m} microbatches x {r} "
                f"replicas (each replica's batch of {size} must split into {m} equal micro-batches). Fix: "
                f"set the per-replica batch size to a multiple of {m} (global batch a multiple of {m * r}), "
                "or change microbatches."
            )

    def _balance_by_time(self, inputs: Tensor, autocast: Callable[[], Any] | None) -> None:
        """Time every block on the first micro-batch where it lies (the mean over replicas), re-cut the
        stages and move the blocks that change rank, with their optimizer state, before the first step."""
        module, pp_group, layout, blocks = self.lightning_module, self._group("pp"), self._layout, self._blocks
        assert module is not None and pp_group is not None and layout is not None and blocks is not None
        sample = inputs[: max(1, inputs.shape[0] // self.microbatches)]
        seconds = profile_stages(
            blocks, layout, sample, group=pp_group, device=self.root_device, profile=profile_blocks_with_output,
            autocast=autocast,
        )  # fmt: skip
        dp_group = self._group("dp")
        if dp_group is not None and self.replicas > 1:
            dist.all_reduce(seconds, group=dp_group)  # on the device: an NCCL group has no CPU backend
            seconds /= self.replicas
        counts = partition_blocks(seconds.tolist(), layout.num_stages)
        rank_zero_info(f"{type(self).__name__}: balance='time': blocks per stage {counts}")
        timed = StageLayout(tuple(counts), layout.ranks)
        if timed != layout:
            optimizers = [unwrap_optimizer(o) for o in self.optimizers]
            move_blocks(blocks, layout, timed, group=pp_group, device=self.root_device, optimizers=optimizers)
            module.__dict__[LAYOUT_KEY] = self._layout = timed
        self._profiled = True


def check_balance(balance: Any) -> Balance:
    if isinstance(balance, str):
        name = balance.lower()
        if name not in BALANCES:
            raise ValueError(
                f"PipelineStrategy(balance={balance!r}): unknown balance; expected one of "
                f"{', '.join(repr(b) for b in BALANCES)} or a list of block counts per stage."
            )
        return name
    try:
        counts = [int(c) for c in balance]
    except (TypeError, ValueError):
        counts = []
    if not counts or any(c < 1 for c in counts) or any(isinstance(c, bool) for c in balance):
        raise ValueError(
            f"PipelineStrategy(balance={balance!r}): expected 'params', 'time' or a list of positive block "
            "counts, one per stage (e.g. [3, 5])."
        )
    return counts


@contextmanager
def instance_attribute(module: nn.Module | None, name: str, value: Any) -> Iterator[None]:
    """Within the block ``module``'s own ``name`` is ``value`` (over its class's), then as it was before."""
    if module is None:
        yield
        return
    had, previous = name in module.__dict__, module.__dict__.get(name)
    module.__dict__[name] = value
    try:
        yield
    finally:
        if had:
            module.__dict__[name] = previous
        else:
            del module.__dict__[name]


def no_state_broadcast(module: nn.Module | None) -> AbstractContextManager[None]:
    """Within the block DDP's setup does not broadcast rank 0's module state (each rank has rank 0's
    weights already, placeholders have none): Lightning skips ``_ddp_params_and_buffers_to_ignore``."""
    names = [n for n, _ in (*module.named_parameters(), *module.named_buffers())] if module is not None else []
    return instance_attribute(module, "_ddp_params_and_buffers_to_ignore", names)


def placeholders_stay(module: nn.Module | None) -> AbstractContextManager[None]:
    """Within the block, ``module.cpu()`` (Lightning's teardown) leaves the ``meta`` placeholders (not copyable)."""

    def cpu() -> nn.Module:
        assert module is not None
        return module._apply(lambda t: t if t.is_meta else t.cpu())

    return instance_attribute(module, "cpu", cpu)


def check_schedule(
    schedule: str, microbatches: int | None, num_stages: int | None, stages_per_rank: int | None
) -> tuple[str, int]:
    """The schedule's lower-case name and the stages per rank (default 2 interleaved, else 1); ``ValueError`` for
    an unknown schedule, a count that is not a positive integer, or several stages per rank not interleaved."""
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise ValueError(
            f"PipelineStrategy(schedule={schedule!r}): unknown schedule; expected one of "
            f"{', '.join(repr(s) for s in SCHEDULES)} (any case). Fix: pass one of them."
        )
    counts = {"microbatches": microbatches, "num_stages": num_stages, "stages_per_rank": stages_per_rank}
    for option, value in counts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"PipelineStrategy({option}={value!r}): expected a positive integer or None (the default)."
            )
    interleaved = name == "interleaved_1f1b"
    if stages_per_rank is None:
        stages_per_rank = 2 if interleaved else 1
    if stages_per_rank > 1 and not interleaved:
        raise ValueError(
            f"PipelineStrategy(schedule={schedule!r}, stages_per_rank={stages_per_rank}): only "
            "'interleaved_1f1b' runs several stages per rank. Fix: pass schedule='interleaved_1f1b', "
            "or stages_per_rank=1."
        )
    return name, stages_per_rank
