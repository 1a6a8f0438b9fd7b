"""PrefetchConfig validation, the device prefetcher, and the recipes' DataModules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies.data import DevicePrefetcher, PrefetchConfig
from recipes.data import DigitsDataModule, ImageFolderDataModule, SyntheticDataModule, SyntheticImages


def test_prefetch_config_to_loader_kwargs() -> None:
    assert PrefetchConfig().loader_kwargs() == {"num_workers": 0, "pin_memory": False}
    kwargs = PrefetchConfig(
        num_workers=2, prefetch_factor=4, persistent_workers=True, pin_memory=True
    ).loader_kwargs()
    assert kwargs == {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True, "pin_memory": True}
    # the kwargs are accepted by a real DataLoader
    DataLoader(TensorDataset(torch.zeros(4)), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": -1}, "num_workers must be an integer >= 0, found -1"),
        ({"num_workers": 1.5}, "num_workers must be an integer >= 0, found 1.5"),
        (
            {"num_workers": 0, "prefetch_factor": 2},
            "prefetch_factor=2 needs loader workers, found num_workers=0",
        ),
        (
            {"num_workers": 2, "prefetch_factor": 0},
            "prefetch_factor must be a positive integer or None, found 0",
        ),
        ({"persistent_workers": True}, "persistent_workers=True needs loader workers"),
        ({"pin_memory": "yes"}, "pin_memory must be true or false, found 'yes'"),
        ({"device_prefetch": 1}, "device_prefetch must be true or false, found 1"),
    ],
)
def test_prefetch_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefetchConfig(**kwargs)


def test_device_prefetcher_is_a_pass_through_on_cpu() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10.0), torch.arange(10)), batch_size=3)
    prefetched = DevicePrefetcher(loader, "cpu")
    assert len(prefetched) == len(loader) == 4
    assert prefetched.sampler is loader.sampler
    for a, b in zip(prefetched, loader, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_device_prefetcher_copies_ahead_on_cuda() -> None:
    loader = DataLoader(TensorDataset(torch.arange(64.0).view(16, 4)), batch_size=4, pin_memory=True)
    out = [b[0] for b in DevicePrefetcher(loader, "cuda")]
    assert all(t.is_cuda for t in out)
    assert torch.equal(torch.cat(out).cpu(), torch.arange(64.0).view(16, 4))


def test_digits_split_is_deterministic_disjoint_and_complete() -> None:
    a, b = DigitsDataModule(batch_size=32, seed=0), DigitsDataModule(batch_size=32, seed=0)
    a.setup(), b.setup()
    sizes = [len(s) for s in (a.train_set, a.val_set, a.test_set)]  # type: ignore[arg-type]
    assert sizes == [1257, 270, 270] and sum(sizes) == 1797
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])  # type: ignore[union-attr]
    x, y = a.train_set.tensors  # type: ignore[union-attr]
    assert x.shape[1:] == (1, 32, 32) and set(y.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4 and float(x.std()) == pytest.approx(1.0, abs=1e-3)
    # disjoint: no test image equals a training image
    train_flat, test_flat = x.flatten(1), a.test_set.tensors[0].flatten(1)  # type: ignore[union-attr]
    assert torch.cdist(test_flat, train_flat).min() > 0
    c = DigitsDataModule(batch_size=32, seed=1)
    c.setup()
    assert not torch.equal(c.test_set.tensors[1], a.test_set.tensors[1])  # type: ignore[union-attr]


def test_synthetic_images_are_seeded_and_learnable_shape() -> None:
    ds = SyntheticImages(8, channels=3, image_size=16, num_classes=4, seed=3)
    x0, y0 = ds[5]
    x1, y1 = SyntheticImages(8, channels=3, image_size=16, num_classes=4, seed=3)[5]
    assert x0.shape == (3, 16, 16) and torch.equal(x0, x1) and int(y0) == int(y1)
    with pytest.raises(IndexError):
        ds[8]
    dm = SyntheticDataModule(batch_size=4, num_samples=16, val_samples=8, test_samples=8, image_size=8)
    dm.setup()
    assert dm.val_set.patterns is dm.train_set.patterns  # type: ignore[union-attr]
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 3, 8, 8) and yb.shape == (4,)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5])
def test_bad_batch_size(batch_size: float) -> None:
    with pytest.raises(ValueError, match=f"data.batch_size is the per-device batch .* found {batch_size}"):
        DigitsDataModule(batch_size=batch_size)  # type: ignore[arg-type]


def test_imagefolder_missing_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="lacks train/ and val/; expected the ImageNet layout"):
        ImageFolderDataModule(root=str(tmp_path / "nowhere"))


def _image_tree(root: Path, classes: int = 2, per_class: int = 3) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (40, 30), color=(40 * c, 10 * i, 90)).save(d / f"{i}.png")


def test_imagefolder_loads_an_imagenet_layout(tmp_path: Path) -> None:
    _image_tree(tmp_path)
    dm = ImageFolderDataModule(root=str(tmp_path), batch_size=2, image_size=24)
    assert dm.num_classes == 2
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 3, 24, 24) and y.tolist() == [0, 0]
    assert len(dm.train_set) == 6  # type: ignore[arg-type]
