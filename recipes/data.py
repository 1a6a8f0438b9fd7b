"""DataModules for the recipes: digits (real, ships with scikit-learn), synthetic, ImageFolder.

Each takes a per-device ``batch_size`` and the prefetch settings of
:class:`lightning_strategies.PrefetchConfig`; the strategy's ``distributed_sampler_kwargs``
decide how samples are sharded (a pipeline shards over replicas, not stages). The training
loader is a :class:`lightning_strategies.ResumableDataLoader`, so ``fit(ckpt_path=...)`` from a
mid-epoch checkpoint continues at the next unseen batch of the same order; the evaluation
loaders are plain (Lightning runs them whole).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_strategies.data import DevicePrefetcher, PrefetchConfig, ResumableDataLoader

__all__ = [
    "DigitsDataModule",
    "ImageFolderDataModule",
    "SkipUnreadable",
    "SyntheticDataModule",
    "SyntheticImages",
    "UnreadableImageError",
]


class _PrefetchingDataModule(pl.LightningDataModule):
    """Loaders built from a :class:`PrefetchConfig`; the train loader optionally device-prefetched."""

    num_classes: int
    in_channels: int

    def __init__(
        self,
        *,
        batch_size: int,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        device_prefetch: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"data.batch_size is the per-device batch and must be a positive integer, found {batch_size!r}"
            )
        self.batch_size = batch_size
        self.prefetch = PrefetchConfig(
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            device_prefetch=device_prefetch,
        )
        self.seed = seed
        self.train_set: Dataset[Any] | None = None
        self.val_set: Dataset[Any] | None = None
        self.test_set: Dataset[Any] | None = None

    def _loader(self, dataset: Dataset[Any] | None, *, train: bool) -> Any:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run; call it before asking for loaders")
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError(f"{type(self).__name__}: the {'train' if train else 'evaluation'} split is empty")
        generator = torch.Generator().manual_seed(self.seed)
        if not train:
            return DataLoader(dataset, batch_size=self.batch_size, generator=generator, **self.prefetch.loader_kwargs())
        if not self.prefetch.device_prefetch:
            # shuffled by an EpochRandomSampler seeded with `seed` (one device), or by the
            # DistributedSampler Lightning swaps in: either way each epoch's order is reproducible
            return ResumableDataLoader(
                dataset,
                batch_size=self.batch_size,
                shuffle=True,
                drop_last=True,
                generator=generator,
                **self.prefetch.loader_kwargs(),
            )
        # Lightning injects its distributed sampler only into DataLoaders; the device prefetcher
        # wraps one, so shard here with the strategy's own sampler arguments.
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        sampler: DistributedSampler[Any] | None = (
            DistributedSampler(dataset, shuffle=True, seed=self.seed, drop_last=True, **kwargs) if kwargs else None
        )
        loader = ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=sampler is None,
            sampler=sampler,
            drop_last=True,
            generator=generator,
            **self.prefetch.loader_kwargs(),
        )
        device = strategy.root_device if strategy is not None else torch.device("cpu")
        return DevicePrefetcher(loader, device)

    def train_dataloader(self) -> Any:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> Any:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> Any:
        return self._loader(self.test_set, train=False)


def _split_indices(
    samples: int, fractions: tuple[float, float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded (train, val, test) indices; ``fractions`` are val's and test's shares."""
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = round(samples * fractions[0]), round(samples * fractions[1])
    return order[n_val + n_test :], order[:n_val], order[n_val : n_val + n_test]


class DigitsDataModule(_PrefetchingDataModule):
    """scikit-learn's 1,797 real 8x8 handwritten digits, upsampled to ``image_size``.

    The split is seeded and deterministic (``val_fraction`` / ``test_fraction`` of the images,
    the rest for training); pixels are scaled to [0, 1], upsampled bilinearly once, then
    normalised with the training split's mean and std. Nothing is downloaded.
    """

    num_classes = 10
    in_channels = 1

    def __init__(
        self,
        *,
        batch_size: int = 64,
        image_size: int = 32,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"val_fraction {val_fraction} and test_fraction {test_fraction} must be in (0, 1) and sum "
                "to less than 1"
            )
        if image_size < 8:
            raise ValueError(f"image_size must be >= 8 (the digits are 8x8), found {image_size}")
        self.image_size = image_size
        self.fractions = (val_fraction, test_fraction)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        pixels, labels = load_digits(return_X_y=True)
        x = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixel values are 0..16
        if self.image_size != 8:
            x = torch.nn.functional.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        y = torch.tensor(labels, dtype=torch.long)
        train, val, test = _split_indices(len(y), self.fractions, self.seed)
        mean, std = x[train].mean(), x[train].std()
        x = (x - mean) / std
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
        self.test_set = TensorDataset(x[test], y[test])


# Sample seeds are seed x this + index + 1: datasets of different seeds share none below a million samples.
_SEED_STRIDE = 1_000_003


class SyntheticImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Seeded random images whose class shifts their mean, so a model can learn them.

    Sample ``i`` is generated from ``seed + i`` on demand (no memory held), identical across
    processes and epochs. ``load_ms`` sleeps per sample to simulate decoding / reading cost.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        seed: int = 0,
        load_ms: float = 0.0,
    ) -> None:
        if num_samples < 0 or channels < 1 or image_size < 1 or num_classes < 2 or load_ms < 0:
            raise ValueError(
                "synthetic data needs num_samples >= 0, channels >= 1, image_size >= 1, num_classes >= 2 and "
                f"load_ms >= 0; found {num_samples}, {channels}, {image_size}, {num_classes}, {load_ms}"
            )
        self.num_samples = num_samples
        self.shape = (channels, image_size, image_size)
        self.num_classes = num_classes
        self.seed = seed
        self.load_ms = load_ms
        # One fixed random pattern per class: the signal a model learns.
        generator = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, *self.shape, generator=generator)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} synthetic samples")
        if self.load_ms:
            time.sleep(self.load_ms / 1000.0)
        # Seeded by (dataset seed, index): every process and loader worker makes the same sample.
        generator = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + index + 1)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        image = 0.5 * self.patterns[label] + torch.randn(self.shape, generator=generator)
        return image, torch.tensor(label)


class SyntheticDataModule(_PrefetchingDataModule):
    """:class:`SyntheticImages` splits of any shape and class count, for benchmarks and tests."""

    def __init__(
        self,
        *,
        batch_size: int = 64,
        num_samples: int = 2048,
        val_samples: int = 256,
        test_samples: int = 256,
        channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        load_ms: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.num_classes = num_classes
        self.in_channels = channels
        self.split_sizes = (num_samples, val_samples, test_samples)
        self.image_kwargs = dict(channels=channels, image_size=image_size, num_classes=num_classes, load_ms=load_ms)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        splits = [  # a seed apart per split (7919, a prime), so their samples differ
            SyntheticImages(size, seed=self.seed + 7919 * i, **self.image_kwargs)  # type: ignore[arg-type]
            for i, size in enumerate(self.split_sizes)
        ]
        # The patterns define the task: validation and test must share the training ones.
        for split in splits[1:]:
            split.patterns = splits[0].patterns
        self.train_set, self.val_set, self.test_set = splits


class UnreadableImageError(OSError):
    """An image file of an ImageFolder that PIL cannot open or decode (and skipping was off or gave up)."""


# What PIL raises for a file it cannot decode: UnidentifiedImageError and "image file is truncated"
# are OSErrors, a broken PNG chunk is a SyntaxError, an image over PIL's pixel limit a
# DecompressionBombError (an Exception). Errors of the transforms are not among them: a bug, not a file.
_UNREADABLE: tuple[type[BaseException], ...] = (OSError, SyntaxError)
try:
    from PIL.Image import DecompressionBombError

    _UNREADABLE += (DecompressionBombError,)
except ImportError:  # pragma: no cover - Pillow comes with torchvision
    pass


class SkipUnreadable(Dataset[tuple[Any, Any]]):
    """A torchvision ``ImageFolder`` whose unreadable images are skipped and counted instead of fatal.

    One corrupt JPEG in a million (a broken download, a full disk) should not end a multi-day run
    at hour 20. When ``folder.loader`` raises for image ``i``, the next image of the folder
    (``i+1``, ``i+2``, ... wrapping around) takes its place, so every batch stays full and every
    rank takes the same number of steps; the file is named in a warning and counted in
    :attr:`skipped` (shared with the loader's worker processes). ``max_consecutive`` unreadable
    images in a row raise :class:`UnreadableImageError`: that is a wrong folder, not bad luck.

    Args:
        folder: a ``torchvision.datasets.ImageFolder`` (or any ``DatasetFolder``): its ``samples``,
            ``loader``, ``transform`` and ``target_transform`` are used.
        skip: False raises :class:`UnreadableImageError` at the first unreadable image instead.
        max_consecutive: unreadable images in a row that make it give up.
    """

    def __init__(self, folder: Any, *, skip: bool = True, max_consecutive: int = 16) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, found {max_consecutive}")
        self.folder = folder
        self.skip = skip
        self.max_consecutive = max_consecutive
        self.counter = multiprocessing.Value("q", 0)

    @property
    def skipped(self) -> int:
        """Loads that hit an unreadable image so far, in this process and its loader workers."""
        return int(self.counter.value)

    @property
    def classes(self) -> list[str]:
        return list(self.folder.classes)

    def __len__(self) -> int:
        return len(self.folder.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        n = len(self)
        first: tuple[str, BaseException] | None = None
        for k in range(min(self.max_consecutive, n)):
            path, target = self.folder.samples[(index + k) % n]
            try:
                image = self.folder.loader(path)
            except _UNREADABLE as err:
                if not self.skip:
                    raise UnreadableImageError(
                        f"cannot read image {path!r} ({type(err).__name__}: {err}); expected an image file PIL "
                        "can open. Fix: replace or delete the file, or skip unreadable images "
                        "(ImageFolderDataModule(skip_unreadable=True), the default)."
                    ) from err
                with self.counter.get_lock():
                    self.counter.value += 1
                warnings.warn(
                    f"skipped unreadable image {path!r} ({type(err).__name__}: {err}); the next image of the "
                    "folder takes its place in the batch. Replace or delete the file.",
                    UserWarning,
                    stacklevel=2,
                )
                first = first or (path, err)
                continue
            if self.folder.transform is not None:
                image = self.folder.transform(image)
            if self.folder.target_transform is not None:
                target = self.folder.target_transform(target)
            return image, target
        assert first is not None
        raise UnreadableImageError(
            f"{min(self.max_consecutive, n)} images in a row from index {index} are unreadable (first: "
            f"{first[0]!r}: {type(first[1]).__name__}: {first[1]}); expected image files PIL can open. Fix: "
            "check that data.root points at images (ImageNet layout root/train/<class>/<image>) and replace the "
            "broken files."
        )


class ImageFolderDataModule(_PrefetchingDataModule):
    """Any ImageFolder tree in the ImageNet layout: ``root/train/<class>/*`` and ``root/val/<class>/*``.

    Training uses RandomResizedCrop + flip; evaluation resizes to ``image_size x 256/224`` and
    centre-crops (the standard ImageNet protocol). ``val/`` also serves as the test split,
    unless ``root/test/`` exists.

    An image PIL cannot read is skipped (the next one takes its place), named in a warning and
    counted (:class:`SkipUnreadable`); :meth:`unreadable_skipped` gives the count, which the
    recipes' module logs as ``data/unreadable_skipped`` (summed over ranks) every epoch.
    ``skip_unreadable=False`` makes the first one an :class:`UnreadableImageError`.
    """

    in_channels = 3

    def __init__(
        self,
        *,
        root: str,
        batch_size: int = 32,
        image_size: int = 224,
        skip_unreadable: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
        self.skip_unreadable = skip_unreadable
        self._counter_pid = -1
        path = Path(os.path.expanduser(str(root)))
        missing = [d for d in ("train", "val") if not (path / d).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"ImageFolder root {str(path)!r} lacks {' and '.join(d + '/' for d in missing)}; expected the "
                "ImageNet layout root/train/<class>/<image> and root/val/<class>/<image>; set data.root=..."
            )
        self.root = path
        self.image_size = image_size
        self.num_classes = len([d for d in (path / "train").iterdir() if d.is_dir()])
        if self.num_classes < 2:
            raise ValueError(f"{path / 'train'} holds {self.num_classes} class folders; a classifier needs >= 2")

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from torchvision import datasets, transforms

        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        train_tf = transforms.Compose(
            [
                transforms.RandomResizedCrop(self.image_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        )
        eval_tf = transforms.Compose(
            [
                transforms.Resize(int(self.image_size * 256 / 224)),
                transforms.CenterCrop(self.image_size),
                transforms.ToTensor(),
                normalize,
            ]
        )
        skip = self.skip_unreadable
        self.train_set = SkipUnreadable(datasets.ImageFolder(str(self.root / "train"), transform=train_tf), skip=skip)
        self.val_set = SkipUnreadable(datasets.ImageFolder(str(self.root / "val"), transform=eval_tf), skip=skip)
        test_dir = self.root / "test" if (self.root / "test").is_dir() else self.root / "val"
        self.test_set = SkipUnreadable(datasets.ImageFolder(str(test_dir), transform=eval_tf), skip=skip)
        self._counter_pid = os.getpid()

    def _splits(self) -> list[SkipUnreadable]:
        return [s for s in (self.train_set, self.val_set, self.test_set) if isinstance(s, SkipUnreadable)]

    def _own_counters(self) -> None:
        # Set up before a fork launch, the rank processes would share the parent's counters and a
        # sum over ranks would count each skip once per rank: each rank process counts afresh.
        if self._counter_pid != os.getpid():
            for split in self._splits():
                split.counter = multiprocessing.Value("q", 0)
            self._counter_pid = os.getpid()

    def unreadable_skipped(self) -> int:
        """Images skipped as unreadable by this rank's loaders (all splits, workers included)."""
        return sum(split.skipped for split in self._splits())

    def train_dataloader(self) -> Any:
        self._own_counters()
        return super().train_dataloader()

    def val_dataloader(self) -> Any:
        self._own_counters()
        return super().val_dataloader()

    def test_dataloader(self) -> Any:
        self._own_counters()
        return super().test_dataloader()
