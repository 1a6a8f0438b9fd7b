"""Input-pipeline settings that overlap loading batch N+1 with training on batch N.

Two independent overlaps, both from the seed's "minimise I/O waits" advice:

* host side, :class:`PrefetchConfig`: DataLoader worker processes decode and collate upcoming
  batches (``num_workers`` x ``prefetch_factor`` batches ahead) while the main process trains;
* device side, :class:`DevicePrefetcher`: the host-to-GPU copy of batch N+1 runs on a side
  CUDA stream while the default stream computes step N (needs pinned memory to be async).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

__all__ = ["DevicePrefetcher", "PrefetchConfig"]

log = logging.getLogger("lightning_strategies")


@dataclass(frozen=True)
class PrefetchConfig:
    """How a DataLoader prepares upcoming batches; checked when built.

    Attributes:
        num_workers: loader worker processes; 0 loads in the training process, in series with
            the step (no host-side overlap).
        prefetch_factor: batches each worker prepares ahead; ``None`` means torch's default (2)
            when ``num_workers > 0``. Only valid with workers.
        pin_memory: page-locked host batches, so a CUDA copy can be asynchronous.
        persistent_workers: keep workers alive between epochs (saves their start-up cost each
            epoch). Only valid with workers.
        device_prefetch: copy batch N+1 to the GPU on a side stream during step N
            (:class:`DevicePrefetcher`); a no-op on CPU.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    device_prefetch: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0, found {self.num_workers!r}; "
                "set data.num_workers=0 to load in the training process"
            )
        if self.prefetch_factor is not None:
            if (
                isinstance(self.prefetch_factor, bool)
                or not isinstance(self.prefetch_factor, int)
                or self.prefetch_factor < 1
            ):
                raise ValueError(
                    f"prefetch_factor must be a positive integer or None, found {self.prefetch_factor!r}"
                )
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

    On CUDA, while the caller trains on batch N, batch N+1 is copied on a dedicated stream; the
    default stream waits for that copy only when batch N+1 is handed out. The copy overlaps
    compute only if the host tensors are pinned (``pin_memory=True``). On any other device this
    is a plain pass-through (said once in the log), so configs can leave it on everywhere.

    ``sampler`` and ``batch_sampler`` of the wrapped loader are exposed so Lightning can still
    call ``set_epoch`` on a distributed sampler.

    Args:
        loader: any iterable of batches (tensors or collections of tensors).
        device: the device batches are moved to.
        non_blocking: asynchronous copies (only asynchronous from pinned memory).
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, *, non_blocking: bool = True) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.non_blocking = non_blocking
        self.active = self.device.type == "cuda"
        global _cpu_notice_given
        if not self.active and not _cpu_notice_given:
            log.info("device_prefetch: batches stay on %s, nothing to copy ahead (a no-op)", self.device)
            _cpu_notice_given = True

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
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
            batch = upcoming
            _record_stream(batch, current_stream)
            upcoming = preload()
            yield batch
