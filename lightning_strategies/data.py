"""Input pipelines that overlap loading with training, and that resume exactly where they stopped.

Host side, :class:`PrefetchConfig` (loader workers prepare upcoming batches while the step runs); device side,
:class:`DevicePrefetcher` (the copy of batch N+1 overlaps step N); restarts, :class:`ResumableDataLoader` (a
mid-epoch checkpoint resumes at the next unseen batch; the async strategy's shared batch queue only at epoch ends).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

__all__ = ["DevicePrefetcher", "EpochRandomSampler", "PrefetchConfig", "ResumableDataLoader"]

log = logging.getLogger("lightning_strategies")


@dataclass(frozen=True)
class PrefetchConfig:
    """How a DataLoader prepares upcoming batches; checked when built (``ValueError``).

    Attributes:
        num_workers: loader worker processes; 0 loads in the training process, in series with the step.
        prefetch_factor: batches each worker prepares ahead (``None``: torch's default, 2). Only valid with workers.
        pin_memory: page-locked host batches, so a CUDA copy can be asynchronous.
        persistent_workers: keep workers alive between epochs (no start-up cost each epoch). Only valid with workers.
        device_prefetch: copy batch N+1 to the GPU during step N (:class:`DevicePrefetcher`); a no-op on CPU.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    device_prefetch: bool = False

    def __post_init__(self) -> None:
        if type(self.num_workers) is not int or self.num_workers < 0:  # a bool is no count
            raise ValueError(
                f"num_workers must be an integer >= 0, found {self.num_workers!r}; "
                "set data.num_workers=0 to load in the training process"
            )
        if self.prefetch_factor is not None:
            if type(self.prefetch_factor) is not int or self.prefetch_factor < 1:
                raise ValueError(f"prefetch_factor must be a positive integer or None, found {self.prefetch_factor!r}")
            if self.num_workers == 0:
                raise ValueError(
                    f"prefetch_factor={self.prefetch_factor} needs loader workers, found num_workers=0; "
                    "set data.num_workers >= 1 or data.prefetch_factor=null"
                )
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError(
                "persistent_workers=True needs loader workers, found num_workers=0; "
                "set data.num_workers >= 1 or data.persistent_workers=false"
            )
        for name in ("pin_memory", "persistent_workers", "device_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, found {getattr(self, name)!r}")

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader``."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking))


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    # The copy was made on the side stream; tell the caching allocator the default stream uses
    # these tensors too, so their memory is not handed out again while compute still reads it.
    apply_to_collection(batch, torch.Tensor, lambda t: t.record_stream(stream))


_cpu_notice_given = False


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``, copied one step ahead.

    On CUDA, batch N+1 is copied on a side stream while the caller trains on batch N; the default stream waits for
    that copy only when batch N+1 is handed out. The copy overlaps compute only from pinned host memory
    (``pin_memory=True``). On any other device it is a pass-through (said once in the log), so configs can leave it
    on. The loader's ``sampler`` and ``batch_sampler`` are exposed (Lightning calls ``set_epoch`` through them);
    ``state_dict`` / ``load_state_dict`` are the wrapped :class:`ResumableDataLoader`'s, less the batch copied ahead,
    so a checkpoint resumes at the right batch (empty over another loader).

    Args:
        loader: any iterable of batches (tensors or collections of tensors).
        non_blocking: asynchronous copies (only asynchronous from pinned memory).
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, *, non_blocking: bool = True) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.non_blocking = non_blocking
        self.active = self.device.type == "cuda"
        self._ahead = 0  # batches taken from the loader but not yet handed out
        global _cpu_notice_given
        if not self.active and not _cpu_notice_given:
            log.info("device_prefetch: batches stay on %s, nothing to copy ahead (a no-op)", self.device)
            _cpu_notice_given = True

    sampler: Any = property(lambda self: getattr(self.loader, "sampler", None))
    batch_sampler: Any = property(lambda self: getattr(self.loader, "batch_sampler", None))
    dataset: Any = property(lambda self: getattr(self.loader, "dataset", None))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state, counting only the batches handed out (``{}`` if it has none)."""
        if not isinstance(self.loader, ResumableDataLoader):
            return {}
        state = self.loader.state_dict()
        if self._ahead and not self.loader._pending:
            state["batches"] -= self._ahead
            state["complete"] = False
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped loader's state (no-op for a loader without one)."""
        if isinstance(self.loader, ResumableDataLoader) and state_dict:
            self.loader.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:
        self._ahead = 0
        if not self.active:
            yield from self.loader
            return
        stream = torch.cuda.Stream(device=self.device)
        it = iter(self.loader)

        def preload() -> Any:
            try:
                host = next(it)
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                return _to_device(host, self.device, self.non_blocking)

        upcoming = preload()
        while upcoming is not None:
            current_stream = torch.cuda.current_stream(self.device)
            current_stream.wait_stream(stream)
            _record_stream(upcoming, current_stream)
            batch, upcoming = upcoming, preload()
            self._ahead = 0 if upcoming is None else 1
            yield batch
        self._ahead = 0


class EpochRandomSampler(RandomSampler):
    """A shuffling sampler whose order is a function of ``(seed, epoch)`` alone.

    ``RandomSampler``'s generator runs on from epoch to epoch, so a fresh process cannot reproduce epoch ``e``
    without replaying epochs ``0..e-1``. This one permutes with a generator seeded ``seed + epoch``, as
    ``DistributedSampler(num_replicas=1, shuffle=True, seed=seed)`` does; Lightning calls :meth:`set_epoch` before
    every epoch. Being a ``RandomSampler``, it is still swapped for a ``DistributedSampler`` in a distributed run.

    Args:
        seed: the base seed; runs with the same seed see the same order in every epoch.
    """

    def __init__(self, data_source: Sized, *, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed((self.seed + self.epoch) % _SEED_RANGE)
        yield from torch.randperm(len(self.data_source), generator=g).tolist()


_SEED_RANGE = 2**63  # torch.Generator.manual_seed takes 64-bit seeds; seed + epoch must stay inside


class _SkipFirst:
    """The loader's index sampler, minus the batches a resumed epoch has already trained on (none of them loaded).

    Torch calls ``iter(loader._index_sampler)`` as it sets up an epoch's iteration (twice with workers; persistent
    workers keep this object), so the skip is read then from ``skip``, a one-item list the loader clears after. Not
    from the loader: a persistent iterator holding it would be a reference cycle, collected late, whose worker
    shutdown then waits out its timeouts."""

    def __init__(self, inner: Any, skip: list[int]) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        for _ in range(self.skip[0]):
            if next(it, _END) is _END:
                break
        return it

    def __len__(self) -> int:
        return len(self.inner)


_END = object()


def _sampler_epoch(loader: DataLoader[Any]) -> int | None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            return epoch
    return None


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that a checkpoint taken mid-epoch resumes at the next unseen batch.

    Lightning 2.6 restores its loop counters from a mid-epoch checkpoint but replays a plain ``DataLoader`` from the
    epoch's first batch. This one takes exactly ``DataLoader``'s arguments, and:

    * its ``state_dict()`` / ``load_state_dict()``, which Lightning calls with every checkpoint and on
      ``fit(ckpt_path=...)``, hold the sampler's epoch and the batches handed to the training loop (not those the
      workers prefetched). On resume the first iteration skips those batches' *indices*, loading nothing for them,
      unless the saved epoch was complete or its sampler epoch differs (a checkpoint at an epoch's last batch
      resumes at the next epoch's first). Skipping, not restoring an iterator, keeps torch's own loader.
    * ``shuffle=True`` builds an :class:`EpochRandomSampler` seeded by ``generator``'s initial seed (else torch's,
      i.e. ``seed_everything``), so every epoch's order is reproducible in a fresh process.

    Iteration starts at the first ``next()``, not at ``iter()``: Lightning creates the first epoch's iterator before
    it calls ``set_epoch``, and with workers a plain loader would fix the wrong epoch's order then.

    Exact means the same indices in the same steps as an uninterrupted run. Random augmentations drawn in the dataset
    are not replayed (workers seed their RNGs per epoch; skipped batches are never loaded), and the sampler's order
    must depend on its epoch alone (``DistributedSampler``, :class:`EpochRandomSampler`), not on global random state.
    The dataset must be map-style (``TypeError`` for an ``IterableDataset``: it has no indices to skip).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                f"ResumableDataLoader found an IterableDataset ({type(dataset).__qualname__}): expected a map-style "
                "dataset, because a resumed epoch skips the indices of the batches already trained on. Fix: use a "
                "plain DataLoader and make the dataset save its own position, or index the data."
            )
        if shuffle and sampler is None and batch_sampler is None:
            generator = kwargs.get("generator")
            seed = generator.initial_seed() if generator is not None else torch.initial_seed()
            sampler = EpochRandomSampler(dataset, seed=seed % _SEED_RANGE)  # type: ignore[arg-type]
            shuffle = None
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, **kwargs)
        self._epoch: int | None = None  # the sampler epoch of the current (or last) iteration
        self._batches = 0  # batches of that iteration handed to the caller
        self._complete = False  # that iteration ran to its end
        self._pending: dict[str, Any] | None = None  # a loaded state, applied at the next iteration
        self._skip = [0]  # batches to skip, read by _SkipFirst while an iteration is set up

    @property
    def _index_sampler(self) -> Any:
        return _SkipFirst(super()._index_sampler, self._skip)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch = _sampler_epoch(self)
        skip = self._resume_skip(epoch)
        self._epoch, self._batches, self._complete = epoch, skip, False
        self._skip[0] = skip
        try:
            iterator = super().__iter__()
        finally:
            self._skip[0] = 0
        for batch in iterator:
            self._batches += 1  # counted when handed over: a checkpoint after this step covers it
            yield batch
        self._complete = True

    def _resume_skip(self, epoch: int | None) -> int:
        pending, self._pending = self._pending, None
        if pending is None or pending.get("complete"):
            return 0
        saved_epoch = pending.get("epoch")
        if epoch is not None and saved_epoch is not None and epoch != saved_epoch:
            return 0  # the checkpoint's epoch is over; this is the next one
        batches = int(pending.get("batches", 0))
        try:
            if batches >= len(self):
                return 0
        except TypeError:  # a batch sampler without a length
            pass
        return batches

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches", "complete"}`` of the current iteration (a loaded one until it starts)."""
        if self._pending is not None:
            return dict(self._pending)
        return {"epoch": self._epoch, "batches": self._batches, "complete": self._complete}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the next iteration from ``state_dict`` (from :meth:`state_dict`)."""
        unknown = set(state_dict) - {"epoch", "batches", "complete"}
        batches = state_dict.get("batches", 0)
        if unknown or isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(
                f"ResumableDataLoader.load_state_dict found {state_dict!r}: expected the keys epoch, batches (an "
                "integer >= 0) and complete, as state_dict() returns. Fix: resume from a checkpoint whose training "
                "loader was a ResumableDataLoader."
            )
        self._pending = dict(state_dict)
