"""The training loader of the async strategies: batches drawn from a shared queue, and what that needs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from lightning_strategies.comm.async_ import DataPlan
from lightning_strategies.strategies._lightning_internals import every_n_train_steps

__all__ = ["DynamicBatchSampler", "check_loop", "plan_of", "training_plan", "with_batch_sampler"]


@dataclass(eq=False)
class DynamicBatchSampler(Sampler[list[int]]):
    """A batch sampler that takes each next batch from a shared queue and stops when it is empty; no ``__len__``
    on purpose, since each rank takes as many batches as it can (Lightning then fetches one ahead).

    Args:
        plan: how the epoch is batched (the same on every rank).
        draw: ``draw(epoch, plan)`` returns the next indices, or ``None`` at the end (it runs in
            the training process, also with loader processes).
        epoch: returns the current epoch when an iteration starts.
        restart: called when an iteration starts (Lightning drops an iterator it prefetched from).
    """

    plan: DataPlan
    draw: Callable[[int, DataPlan], list[int] | None]
    epoch: Callable[[], int]
    restart: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        if self.restart is not None:
            self.restart()  # a new iteration: what the last one drew and no step trained is given back
        epoch = self.epoch()  # read lazily: Lightning creates the iterator before the epoch starts
        while (batch := self.draw(epoch, self.plan)) is not None:
            yield batch


def training_plan(name: str, dataloader: object, workers: int) -> DataPlan:
    """The :class:`DataPlan` of a training loader that ``workers`` share batch by batch: ``TypeError`` unless a
    ``DataLoader`` over a map-style dataset with a batch size, ``ValueError`` for fewer batches than workers."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            f"{name} found a training loader of type {type(dataloader).__qualname__}"
            f"{' over an IterableDataset' if isinstance(dataloader, DataLoader) else ''}: expected a "
            "torch DataLoader over a map-style dataset, because workers draw batch indices from a shared "
            "queue. Fix: return a DataLoader(dataset, batch_size=..., shuffle=...) from train_dataloader() "
            "(optionally in a DevicePrefetcher)."
        )
    plan = plan_of(name, dataloader)
    if plan.num_batches < workers:
        raise ValueError(
            f"{name} found {plan.num_batches} training batches per epoch ({plan.num_samples} samples in "
            f"batches of {plan.batch_size}) for {workers} workers: expected at least one batch per "
            "worker, because a rank that trains on no batch skips the epoch-end validation its peers run. "
            "Fix: a smaller batch size, or fewer processes."
        )
    return plan


def plan_of(name: str, dataloader: DataLoader) -> DataPlan:
    """The batching of ``dataloader`` as a :class:`DataPlan` (its sampler decides shuffle and seed)."""
    sampler = dataloader.sampler
    batch_size = dataloader.batch_size
    drop_last = dataloader.drop_last
    if batch_size is None:  # a custom batch sampler
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
        drop_last = bool(getattr(dataloader.batch_sampler, "drop_last", False))
        sampler = getattr(dataloader.batch_sampler, "sampler", sampler)
    if not isinstance(batch_size, int):
        raise TypeError(
            f"{name} could not find the batch size of the training DataLoader (batch "
            f"sampler {type(dataloader.batch_sampler).__qualname__}): expected DataLoader(batch_size=...) or a "
            "batch sampler with a `batch_size`. Fix: pass batch_size to the DataLoader."
        )
    shuffle = isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))
    seed = int(sampler.seed) if isinstance(sampler, DistributedSampler) else 0
    return DataPlan(len(dataloader.dataset), batch_size, drop_last, shuffle, seed)  # type: ignore[arg-type]


def check_loop(name: str, trainer: pl.Trainer) -> None:
    """Refuse what needs the same batches on every rank: steps, mid-epoch validation or saves."""
    if trainer.max_steps != -1:
        raise ValueError(
            f"{name} found Trainer(max_steps={trainer.max_steps}): expected max_steps=-1, because the ranks "
            "take different numbers of steps per epoch, so they would stop in different epochs and their "
            "epoch-end collectives would never match. Fix: train for max_epochs (and drop max_steps)."
        )
    interval = trainer.val_check_interval
    if not (isinstance(interval, float) and interval == 1.0) or trainer.check_val_every_n_epoch is None:
        raise ValueError(
            f"{name} found Trainer(val_check_interval={interval!r}, check_val_every_n_epoch="
            f"{trainer.check_val_every_n_epoch!r}): expected validation at epoch ends "
            "(val_check_interval=1.0 and check_val_every_n_epoch an integer), because the ranks count "
            "different batches and would validate at different times. Fix: validate every n epochs."
        )
    for callback in trainer.checkpoint_callbacks:
        if every := every_n_train_steps(callback):
            raise ValueError(
                f"{name} found ModelCheckpoint(every_n_train_steps={every}): expected checkpoints at epoch "
                "ends, because the ranks take different numbers of steps and saving is collective (and the "
                "queue's position within an epoch is not saved). Fix: ModelCheckpoint(every_n_epochs=...)."
            )


def with_batch_sampler(dataloader: DataLoader, sampler: Sampler[list[int]]) -> DataLoader:
    """``dataloader`` with ``sampler`` for its batches (and its own loader processes, if any)."""
    kept = ["num_workers", "collate_fn", "pin_memory", "timeout"]
    if dataloader.num_workers > 0:  # loader-process options: DataLoader refuses some without them
        kept += ["prefetch_factor", "persistent_workers", "worker_init_fn", "multiprocessing_context"]
    return DataLoader(dataloader.dataset, batch_sampler=sampler, **{k: getattr(dataloader, k) for k in kept})
