"""DataModules for the recipes: digits (real, ships with scikit-learn), synthetic, ImageFolder.

Each takes a per-device ``batch_size`` and the prefetch settings of
:class:`lightning_strategies.PrefetchConfig`; the strategy's ``distributed_sampler_kwargs``
decide how samples are sharded (a pipeline shards over replicas, not stages).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_strategies.data import DevicePrefetcher, PrefetchConfig

__all__ = ["DigitsDataModule", "ImageFolderDataModule", "SyntheticDataModule", "SyntheticImages"]


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
        if not (train and self.prefetch.device_prefetch):
            return DataLoader(
                dataset,
                batch_size=self.batch_size,
                shuffle=train,
                drop_last=train,
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
        loader = DataLoader(
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


def _split(n: int, fractions: tuple[float, float], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = round(n * fractions[0]), round(n * fractions[1])
    return perm[n_val + n_test :], perm[:n_val], perm[n_val : n_val + n_test]


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

        x_np, y_np = load_digits(return_X_y=True)
        x = torch.tensor(x_np, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        if self.image_size != 8:
            x = torch.nn.functional.interpolate(
                x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        y = torch.tensor(y_np, dtype=torch.long)
        train, val, test = _split(len(y), self.fractions, self.seed)
        mean, std = x[train].mean(), x[train].std()
        x = (x - mean) / std
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
        self.test_set = TensorDataset(x[test], y[test])


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
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, *self.shape, generator=g)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} synthetic samples")
        if self.load_ms:
            time.sleep(self.load_ms / 1000.0)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        image = 0.5 * self.patterns[label] + torch.randn(self.shape, generator=g)
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
        common = dict(channels=channels, image_size=image_size, num_classes=num_classes, load_ms=load_ms)
        self.sizes = (num_samples, val_samples, test_samples)
        self.common = common

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        sets = [
            SyntheticImages(n, seed=self.seed + 7919 * i, **self.common)  # type: ignore[arg-type]
            for i, n in enumerate(self.sizes)
        ]
        # The patterns define the task: validation and test must share the training ones.
        for s in sets[1:]:
            s.patterns = sets[0].patterns
        self.train_set, self.val_set, self.test_set = sets


class ImageFolderDataModule(_PrefetchingDataModule):
    """Any ImageFolder tree in the ImageNet layout: ``root/train/<class>/*`` and ``root/val/<class>/*``.

    Training uses RandomResizedCrop + flip; evaluation resizes to ``image_size x 256/224`` and
    centre-crops (the standard ImageNet protocol). ``val/`` also serves as the test split,
    unless ``root/test/`` exists.
    """

    in_channels = 3

    def __init__(self, *, root: str, batch_size: int = 32, image_size: int = 224, **kwargs: Any) -> None:
        super().__init__(batch_size=batch_size, **kwargs)
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
        self.train_set = datasets.ImageFolder(str(self.root / "train"), transform=train_tf)
        self.val_set = datasets.ImageFolder(str(self.root / "val"), transform=eval_tf)
        test_dir = self.root / "test" if (self.root / "test").is_dir() else self.root / "val"
        self.test_set = datasets.ImageFolder(str(test_dir), transform=eval_tf)
