"""PrefetchConfig validation, the device prefetcher, the resumable loader, and the recipes' DataModules.

The prefetcher's CUDA copies are tested in ``tests/gpu/test_prefetch_gpu.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utils import StopAfter, TinyRegressor, regression_data
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from lightning_strategies.data import DevicePrefetcher, EpochRandomSampler, PrefetchConfig, ResumableDataLoader
from recipes.data import DigitsDataModule, ImageFolderDataModule, SyntheticDataModule, SyntheticImages


def test_prefetch_config_to_loader_kwargs() -> None:
    assert PrefetchConfig().loader_kwargs() == {"num_workers": 0, "pin_memory": False}
    kwargs = PrefetchConfig(num_workers=2, prefetch_factor=4, persistent_workers=True, pin_memory=True).loader_kwargs()
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


# -- ResumableDataLoader ---------------------------------------------------------------------------


class _Counted(Dataset[int]):
    """``range(n)``, counting the samples loaded (in this process)."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded += 1
        return i


def _sampler(kind: str, data: Dataset[Any]) -> dict[str, Any]:
    if kind == "shuffle":
        return {"shuffle": True, "generator": torch.Generator().manual_seed(7)}
    # rank 1 of 2, as Lightning injects it for DDP, in epoch 3
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)  # type: ignore[var-annotated]
    sampler.set_epoch(3)
    return {"sampler": sampler}


@pytest.mark.parametrize("kind", ["shuffle", "distributed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_loader_skips_exactly_the_batches_handed_out(kind: str, workers: int) -> None:
    data = _Counted(60)
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": workers}
    if workers:
        kwargs["persistent_workers"] = True  # the index sampler is kept across epochs: skip once only
    want = [b.tolist() for b in ResumableDataLoader(data, **_sampler(kind, data), **kwargs)]
    first = ResumableDataLoader(data, **_sampler(kind, data), **kwargs)
    it = iter(first)
    taken = [next(it).tolist() for _ in range(3)]  # workers have prefetched further: not counted
    state = first.state_dict()
    assert state == {"epoch": None if kind == "shuffle" else 3, "batches": 3, "complete": False} or (
        kind == "shuffle" and state["epoch"] == 0 and state["batches"] == 3
    )
    del it

    resumed = ResumableDataLoader(data, **_sampler(kind, data), **kwargs)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # a loaded state is what a checkpoint taken now would save
    data.loaded = 0
    rest = [b.tolist() for b in resumed]
    assert taken + rest == want
    if workers == 0:
        assert data.loaded == sum(len(b) for b in rest)  # the skipped batches were never loaded
    assert resumed.state_dict()["batches"] == len(want) and resumed.state_dict()["complete"]
    # the next epoch is whole again
    assert [b.tolist() for b in resumed] == want


def test_a_finished_epoch_resumes_at_the_start_of_the_next() -> None:
    data = TensorDataset(torch.arange(20))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=1)  # type: ignore[var-annotated]
    loader = ResumableDataLoader(data, batch_size=5, sampler=sampler)
    for epoch, state in [
        (0, {"epoch": 0, "batches": 2, "complete": True}),  # ran to its end
        (1, {"epoch": 0, "batches": 2, "complete": False}),  # Lightning already set the next epoch
        (0, {"epoch": 0, "batches": 4, "complete": False}),  # every batch handed out (sized loader)
    ]:
        sampler.set_epoch(epoch)
        loader.load_state_dict(state)
        assert len(list(loader)) == 4, state
    sampler.set_epoch(0)
    loader.load_state_dict({"epoch": 0, "batches": 2, "complete": False})
    assert len(list(loader)) == 2  # the same epoch, mid-way: the rest of it


def test_epoch_random_sampler_is_a_one_replica_distributed_sampler() -> None:
    data = TensorDataset(torch.arange(37))
    ours = EpochRandomSampler(data, seed=11)
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=11)  # type: ignore[var-annotated]
    orders = []
    for epoch in range(3):
        ours.set_epoch(epoch)
        reference.set_epoch(epoch)
        orders.append(list(ours))
        assert orders[-1] == list(reference)
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(37))
    # shuffle=True builds it, seeded by the generator: a fresh loader repeats any epoch's order
    loader = ResumableDataLoader(data, batch_size=37, shuffle=True, generator=torch.Generator().manual_seed(11))
    assert isinstance(loader.sampler, EpochRandomSampler) and loader.sampler.seed == 11
    loader.sampler.set_epoch(2)
    assert next(iter(loader))[0].tolist() == orders[2]


class _Stream(IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(3)


def test_resumable_loader_rejects_what_it_cannot_resume() -> None:
    with pytest.raises(TypeError, match=r"found an IterableDataset .*expected a map-style dataset"):
        ResumableDataLoader(_Stream())
    loader = ResumableDataLoader(TensorDataset(torch.arange(4)))
    for bad in ({"batches": -1}, {"batches": 1.5}, {"position": 3}):
        with pytest.raises(ValueError, match="expected the keys epoch, batches"):
            loader.load_state_dict(bad)


def test_device_prefetcher_passes_the_loader_state_through_on_cpu() -> None:
    data = TensorDataset(torch.arange(12))
    loader = ResumableDataLoader(data, batch_size=3)
    prefetched = DevicePrefetcher(loader, "cpu")
    it = iter(prefetched)
    next(it), next(it)
    assert prefetched.state_dict() == loader.state_dict() == {"epoch": None, "batches": 2, "complete": False}
    other = DevicePrefetcher(ResumableDataLoader(data, batch_size=3), "cpu")
    other.load_state_dict(prefetched.state_dict())
    assert [b[0].tolist() for b in other] == [[6, 7, 8], [9, 10, 11]]
    assert DevicePrefetcher(DataLoader(data), "cpu").state_dict() == {}


# -- ResumableDataLoader under Lightning, one device --------------------------------------------


class _IndexedRegressor(TinyRegressor):
    """Records the dataset indices of every step (the rows of ``regression_data`` are distinct)."""

    def __init__(self) -> None:
        super().__init__()
        x = regression_data().tensors[0]
        self.index = {row.numpy().tobytes(): i for i, row in enumerate(x)}
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append([self.index[r.numpy().tobytes()] for r in batch[0]])
        return super().training_step(batch, batch_idx)


def _fit_one_device(
    model: _IndexedRegressor, *, workers: int, limit: dict[str, int], callbacks: list[pl.Callback], ckpt: Path | None
) -> list[list[int]]:
    loader = ResumableDataLoader(
        regression_data(), batch_size=16, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, **limit,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=ckpt)
    return model.seen


# (where the checkpoint is taken, after which step, the run's limit, loader workers); 4 steps an epoch
LIGHTNING_CASES = {
    "mid_epoch": ("batch", 6, {"max_epochs": 3}, 0),
    # Lightning restores the loader here (its epoch looks unfinished); it must start the next epoch
    "last_batch_of_epoch": ("batch", 8, {"max_epochs": 3}, 0),
    # iteration-based training (Lightning's other restart path)
    "mid_epoch_max_steps": ("batch", 6, {"max_steps": 12}, 0),
    # not restored; with workers a plain loader would fix the order before set_epoch (epoch 0's)
    "epoch_end_workers": ("epoch", 4, {"max_epochs": 2}, 1),
}


@pytest.mark.parametrize("case", sorted(LIGHTNING_CASES))
def test_lightning_resume_on_one_device_sees_the_uninterrupted_order(case: str, tmp_path: Path) -> None:
    where, step, limit, workers = LIGHTNING_CASES[case]
    want = _fit_one_device(_IndexedRegressor(), workers=workers, limit=limit, callbacks=[], ckpt=None)
    ckpt = tmp_path / "stop.ckpt"
    first = _fit_one_device(
        _IndexedRegressor(), workers=workers, limit=limit, callbacks=[StopAfter(where, ckpt, step=step)], ckpt=None
    )
    rest = _fit_one_device(_IndexedRegressor(), workers=workers, limit=limit, callbacks=[], ckpt=ckpt)
    assert len(first) == step and len(want) == len(first) + len(rest)
    assert first + rest == want
