"""What the bad-input table's rows do (tests/integration/test_bad_input.py): their actions and checks.

An action gives the library or the app one bad thing and returns how each rank (or the one process)
ended; a check makes further assertions on a row that ends without an error. Multi-process actions run
2 ranks forked from the pytest process, each a Lightning job launched "by hand" (``in_ranks``), on the
small models, data and fits below.
"""

from __future__ import annotations

import functools
import io
import os
import queue
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from app_utils import FEW_BATCHES, ROOT, compose_cfg
from dist_utils import end_ranks, start_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_strategies
from lightning_strategies import (
    AsyncParameterServerStrategy,
    AtomicCheckpointIO,
    ParameterServerStrategy,
    PipelineStrategy,
    RingAllReduceStrategy,
)
from lightning_strategies.checkpoint import temp_files_of
from recipes.classification import ClassificationModule
from recipes.data import ImageFolderDataModule
from recipes.models import build_model
from recipes.train import run
from tests.lightning_utils import TinyRegressor, quiet_trainer, regression_data

RANK_TIMEOUT_S = 120.0  # the whole multi-process row; generous for a loaded 2-core machine
PG_TIMEOUT = timedelta(seconds=30)  # a rank left waiting for a stopped peer fails after this


# -- ranks launched by hand ----------------------------------------------------------------------


@dataclass
class Ended:
    """How one rank (or the one process of a unit row) ended."""

    rank: int
    error: str | None  # the exception's type name, None when it returned
    message: str = ""
    value: Any = None
    seconds: float = 0.0


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    start = time.monotonic()
    try:
        value = fn(rank, *args, **kwargs)
        out.put((rank, None, "", value, time.monotonic() - start))
    except BaseException as err:
        notes = "\n".join(getattr(err, "__notes__", ()))  # the peer diagnosis lives in a note
        out.put((rank, type(err).__name__, f"{err}\n{notes}" if notes else str(err), None, time.monotonic() - start))


def in_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, **kwargs: Any) -> list[Ended]:
    """Run ``fn(rank, *args, **kwargs)`` as ``world`` forked ranks of one job; how each ended, by rank.

    Values must pickle without shared memory (bytes, lists, numbers). A rank that neither
    returns nor raises within ``RANK_TIMEOUT_S`` is reported as ``"Timeout"``; a rank that
    dies as ``"Died"``. Every process started here is joined or SIGKILLed before returning.
    """
    results, procs = start_ranks(_rank_main, world, lambda r, port, q: (fn, r, world, port, args, kwargs, q))
    ended: dict[int, Ended] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(ended) < world and time.monotonic() < deadline:
            try:
                rank, error, message, value, seconds = results.get(timeout=0.5)
                ended[rank] = Ended(rank, error, message, value, seconds)
            except queue.Empty:
                for r, p in enumerate(procs):  # exit code 0: its result may still be in the pipe
                    if r not in ended and p.exitcode not in (None, 0):
                        ended[r] = Ended(r, "Died", f"exit code {p.exitcode}")
    finally:
        end_ranks(procs, join_timeout_s=10)
    return [ended.get(r, Ended(r, "Timeout", f"no answer within {RANK_TIMEOUT_S:.0f}s")) for r in range(world)]


def in_process(fn: Callable[[], Any]) -> list[Ended]:
    """A unit row's single process, reported like one rank."""
    try:
        return [Ended(0, None, "", fn())]
    except Exception as err:
        return [Ended(0, type(err).__name__, str(err))]


# -- models, data and fits ---------------------------------------------------------------------


class PipeRegressor(TinyRegressor):
    """TinyRegressor with the pipeline contract: its net is 3 blocks (no batch norm: exact math)."""

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


class OneBlock(PipeRegressor):
    def pipeline_layers(self) -> nn.Sequential:
        return nn.Sequential(self.net)


def _strategy(name: str) -> Any:
    kwargs: dict[str, Any] = {"timeout": PG_TIMEOUT}
    return {
        "ring": RingAllReduceStrategy,
        "ps": ParameterServerStrategy,
        "async": AsyncParameterServerStrategy,
        "pipeline": PipelineStrategy,
    }[name](**kwargs)


def _trainer(strategy: Any, devices: int, **kwargs: Any) -> pl.Trainer:
    return quiet_trainer(strategy, devices, **kwargs)


def _state_bytes(module: nn.Module) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, buf)
    return buf.getvalue()


def _state(data: bytes) -> dict[str, torch.Tensor]:
    return dict(torch.load(io.BytesIO(data), weights_only=True))


def _regression_fit(
    rank: int, strategy: str, *, epochs: int, ckpt_in: str | None = None, ckpt_out: str | None = None
) -> bytes:
    """SGD with momentum on 64 samples in sequential batches of 8, the same batches on every rank
    (``use_distributed_sampler=False``): data parallel then averages equal gradients, so ring,
    ps and pipeline all follow the single-device run (pipeline: over micro-batches of 1)."""
    devices = 1 if strategy == "single" else 2
    trainer = _trainer(
        "auto" if strategy == "single" else _strategy(strategy),
        devices,
        max_epochs=epochs,
        use_distributed_sampler=False,
        plugins=[AtomicCheckpointIO()] if strategy == "single" else None,
    )
    module = PipeRegressor()
    trainer.fit(module, DataLoader(regression_data(), batch_size=8), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)  # every rank: the strategies gather the full state
    return _state_bytes(module)


def _small_classifier(width: int = 4, **kwargs: Any) -> ClassificationModule:
    torch.manual_seed(0)
    return ClassificationModule(
        build_model("small_cnn", num_classes=4, in_channels=1, width=width),
        num_classes=4,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        **kwargs,
    )


def _images(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class PoisonAt(ClassificationModule):
    """Fills the inputs of optimizer step ``at`` (0-based) with ``value`` on the given ranks:
    the loss of that step turns NaN/inf there, as a corrupt sample or an overflow would."""

    def __init__(self, *, at: int, value: float, ranks: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.value, self.ranks = at, value, ranks

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.at and self.global_rank in self.ranks:
            batch[0].fill_(self.value)


def _poisoned_fit(rank: int, strategy: str, at: int, value: float, ranks: tuple[int, ...]) -> int:
    torch.manual_seed(0)
    module = PoisonAt(
        at=at,
        value=value,
        ranks=ranks,
        model=build_model("small_cnn", num_classes=4, in_channels=1, width=4),
        num_classes=4,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )
    trainer = _trainer(_strategy(strategy), 2, max_epochs=2, limit_val_batches=0)
    trainer.fit(module, DataLoader(_images(), batch_size=8))
    return trainer.global_step


# -- the rows' actions ---------------------------------------------------------------------------


def unknown_strategy_trainer(tmp: Path) -> list[Ended]:
    return in_process(lambda: pl.Trainer(strategy="rnig", accelerator="cpu", devices=2))


def unknown_strategy_app(tmp: Path) -> list[Ended]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "strategy=rnig"],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    error = None if proc.returncode == 0 else f"exit {proc.returncode}"
    return [Ended(0, error, proc.stderr + proc.stdout)]


def stages_not_dividing_world(tmp: Path) -> list[Ended]:
    return in_process(lambda: pl.Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(num_stages=2)))


def stages_not_dividing_world_app(tmp: Path) -> list[Ended]:
    cfg = compose_cfg(["trainer=ddp_sim", "strategy=pipeline", "strategy.num_stages=3"], output_dir=tmp)
    return in_process(lambda: run(cfg))


def _one_block_fit(rank: int) -> int:
    trainer = _trainer(_strategy("pipeline"), 2, max_steps=1)
    trainer.fit(OneBlock(), DataLoader(regression_data(), batch_size=8))
    return trainer.global_step


def more_stages_than_blocks(tmp: Path) -> list[Ended]:
    return in_ranks(_one_block_fit)


def _pipeline_small_batch(rank: int) -> int:
    trainer = _trainer(_strategy("pipeline"), 2, max_steps=1)
    trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=2))  # 8 micro-batches by default
    return trainer.global_step


def batch_smaller_than_microbatches(tmp: Path) -> list[Ended]:
    return in_ranks(_pipeline_small_batch)


def global_batch_below_replicas_app(tmp: Path) -> list[Ended]:
    cfg = compose_cfg(["trainer=ddp_sim", "global_batch_size=1"], output_dir=tmp)
    return in_process(lambda: run(cfg))


def per_device_batch_zero_library(tmp: Path) -> list[Ended]:
    return in_process(lambda: lightning_strategies.global_batch_size(0, replicas=2))


def _corrupt(tmp: Path, kind: str) -> Path:
    good = tmp / "ckpts" / "epoch=0.ckpt"
    _regression_fit(0, "single", epochs=1, ckpt_out=str(good))
    data = good.read_bytes()
    bad = tmp / "ckpts" / "last.ckpt"
    bad.write_bytes({"truncated": data[: len(data) // 2], "random": os.urandom(4096), "empty": b""}[kind])
    return bad


def corrupt_checkpoint_single(kind: str) -> Callable[[Path], list[Ended]]:
    def act(tmp: Path) -> list[Ended]:
        bad = _corrupt(tmp, kind)
        return in_process(lambda: _regression_fit(0, "single", epochs=2, ckpt_in=str(bad)))

    return act


def corrupt_checkpoint_ring(tmp: Path) -> list[Ended]:
    bad = _corrupt(tmp, "truncated")
    return in_ranks(_regression_fit, "ring", epochs=2, ckpt_in=str(bad))


def cross_load(src: str, dst: str) -> Callable[[Path], list[Ended]]:
    """``src`` trains 1 epoch and saves; ``dst`` resumes from that file for a 2nd epoch."""

    def act(tmp: Path) -> list[Ended]:
        ckpt = str(tmp / f"{src}.ckpt")
        if src == "single":
            _regression_fit(0, "single", epochs=1, ckpt_out=ckpt)
        else:
            saved = in_ranks(_regression_fit, src, epochs=1, ckpt_out=ckpt)
            assert all(e.error is None for e in saved), [(e.error, e.message[-500:]) for e in saved]
        if dst == "single":
            return in_process(lambda: _regression_fit(0, "single", epochs=2, ckpt_in=ckpt))
        return in_ranks(_regression_fit, dst, epochs=2, ckpt_in=ckpt)

    return act


def equals_uninterrupted_single_run(ended: list[Ended], tmp: Path) -> None:
    # 2 ranks on equal batches average equal gradients exactly, and the servers run the same SGD
    # arithmetic; the pipeline sums 8 micro-batch losses / 8 instead of one batch mean, which
    # rounds differently in the last bits: 1e-5 relative covers 8 steps of that, far below the
    # weights' change per step (~1e-2).
    reference = _state(_regression_fit(0, "single", epochs=2))
    held: set[str] = set()
    for e in ended:
        got = _state(e.value)
        assert got.keys() == reference.keys()
        for k in reference:
            if got[k].is_meta:  # a pipeline rank holds its own stages only; together, all of them
                continue
            held.add(k)
            torch.testing.assert_close(got[k], reference[k], rtol=1e-5, atol=1e-6, msg=f"rank {e.rank}: {k}")
    assert held == set(reference)


def other_model_recipe(tmp: Path) -> list[Ended]:
    ckpt = tmp / "narrow.ckpt"
    trainer = _trainer("auto", 1, max_steps=1, plugins=[AtomicCheckpointIO()])
    trainer.fit(_small_classifier(width=4), DataLoader(_images(), batch_size=8))
    trainer.save_checkpoint(ckpt)

    def resume_wider() -> int:
        wider = _trainer("auto", 1, max_steps=2, plugins=[AtomicCheckpointIO()])
        wider.fit(_small_classifier(width=8), DataLoader(_images(), batch_size=8), ckpt_path=ckpt)
        return wider.global_step

    return in_process(resume_wider)


def other_model_library(tmp: Path) -> list[Ended]:
    ckpt = tmp / "in8.ckpt"
    _regression_fit(0, "single", epochs=1, ckpt_out=str(ckpt))

    def resume_other() -> int:
        trainer = _trainer("auto", 1, max_epochs=2)
        trainer.fit(TinyRegressor(in_dim=5), DataLoader(regression_data(in_dim=5), batch_size=8), ckpt_path=ckpt)
        return trainer.global_step

    return in_process(resume_other)


def corrupt_checkpoint_app(tmp: Path) -> list[Ended]:
    bad = _corrupt(tmp, "truncated")
    cfg = compose_cfg([*FEW_BATCHES, "model=small_cnn", f"resume={bad}"], output_dir=tmp / "run")
    return in_process(lambda: run(cfg))


def other_model_app(tmp: Path) -> list[Ended]:
    small = [*FEW_BATCHES, "model=small_cnn", "run_test=false"]
    run(compose_cfg([*small, "model.width=8"], output_dir=tmp / "narrow"))
    last = tmp / "narrow" / "checkpoints" / "last.ckpt"
    cfg = compose_cfg([*small, "model.width=16", f"resume={last}"], output_dir=tmp / "wide")
    return in_process(lambda: run(cfg))


def non_finite(strategy: str, value: float, ranks: tuple[int, ...]) -> Callable[[Path], list[Ended]]:
    return lambda tmp: in_ranks(_poisoned_fit, strategy, 2, value, ranks)


def non_finite_single_keeps_last_checkpoint(tmp: Path) -> list[Ended]:
    def fit() -> int:
        module = PoisonAt(
            at=2,
            value=float("nan"),
            ranks=(0,),
            model=_small_classifier().model,
            num_classes=4,
            optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        )
        every_step = ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=0, every_n_train_steps=1)
        trainer = _trainer(
            "auto", 1, max_epochs=1, callbacks=[every_step], enable_checkpointing=True, plugins=[AtomicCheckpointIO()]
        )
        trainer.fit(module, DataLoader(_images(), batch_size=8))
        return trainer.global_step

    return in_process(fit)


def last_checkpoint_is_step_2_and_finite(ended: list[Ended], tmp: Path) -> None:
    saved = AtomicCheckpointIO().load_checkpoint(tmp / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2  # written after step 2; step 3 broke the weights and saved nothing
    assert all(bool(torch.isfinite(v).all()) for v in saved["state_dict"].values() if v.is_floating_point())


def _image_tree(root: Path, *, bad: int, good_per_class: int = 4) -> list[Path]:
    """train/ and val/ with 2 classes of 8x8 PNGs; ``bad`` unreadable files in train/c0."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(good_per_class if split == "train" else 2):
                Image.new("RGB", (8, 8), color=(100 * c, 30 * i, 0)).save(root / split / f"c{c}" / f"{i}.png")
    broken = []
    for i in range(bad):
        path = root / "train" / "c0" / f"broken{i}.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)  # PNG magic, garbage after it
        broken.append(path)
    return broken


def unreadable_image_loader(workers: int) -> Callable[[Path], list[Ended]]:
    def act(tmp: Path) -> list[Ended]:
        broken = _image_tree(tmp, bad=1, good_per_class=4)  # 9 train images, batch 3: 3 full batches
        dm = ImageFolderDataModule(root=str(tmp), batch_size=3, image_size=8, num_workers=workers)
        dm.setup("fit")

        def one_epoch() -> dict[str, Any]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sizes = [len(y) for _, y in dm.train_dataloader()]
            return {
                "sizes": sizes,
                "skipped": dm.unreadable_skipped(),
                "broken": str(broken[0]),
                "warnings": [str(w.message) for w in caught],
            }

        return in_process(one_epoch)

    return act


def skipped_and_counted(workers: int) -> Callable[[list[Ended], Path], None]:
    def check(ended: list[Ended], tmp: Path) -> None:
        out = ended[0].value
        assert out["sizes"] == [3, 3, 3]  # every batch full: the next image took the broken one's place
        assert out["skipped"] == 1  # counted once per pass, in the loader's worker processes too
        if workers == 0:  # a worker process's warnings go to its stderr, not to this process
            assert any(out["broken"] in w and "skipped unreadable image" in w for w in out["warnings"]), out

    return check


def unreadable_image_strict(tmp: Path) -> list[Ended]:
    _image_tree(tmp, bad=1)
    dm = ImageFolderDataModule(root=str(tmp), batch_size=9, image_size=8, skip_unreadable=False)
    dm.setup("fit")
    return in_process(lambda: next(iter(dm.train_dataloader())))


def mostly_unreadable_images(tmp: Path) -> list[Ended]:
    _image_tree(tmp, bad=20, good_per_class=1)  # train/c0: 0.png, broken0..19.png; train/c1: 0.png
    dm = ImageFolderDataModule(root=str(tmp), batch_size=2, image_size=8)
    dm.setup("fit")
    return in_process(lambda: dm.train_set[1])  # type: ignore[index]


def _imagefolder_ring_fit(root: str) -> float:
    dm = ImageFolderDataModule(root=root, batch_size=2, image_size=8)
    dm.setup("fit")  # in the launching process, as the app does: the forked ranks inherit the splits
    module = ClassificationModule(
        build_model("small_cnn", num_classes=2, in_channels=3, width=4),
        num_classes=2,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
    )
    trainer = _trainer(RingAllReduceStrategy(start_method="fork", timeout=PG_TIMEOUT), 2, max_epochs=1)
    trainer.fit(module, datamodule=dm)
    return float(trainer.callback_metrics["data/unreadable_skipped"])


def unreadable_image_fit(tmp: Path) -> list[Ended]:
    _image_tree(tmp, bad=1, good_per_class=4)
    (tmp / "train" / "c1" / "3.png").unlink()  # 8 train images: 4 per rank, 2 full batches, none dropped or padded
    return in_process(lambda: _imagefolder_ring_fit(str(tmp)))


def app_rows(overrides: list[str]) -> Callable[[Path], list[Ended]]:
    return lambda tmp: in_process(lambda: run(compose_cfg(overrides, output_dir=tmp)))


def empty_loader_library(tmp: Path) -> list[Ended]:
    def fit() -> dict[str, Any]:
        trainer = _trainer("auto", 1, max_epochs=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyRegressor(), DataLoader(TensorDataset(torch.zeros(0, 8), torch.zeros(0, 4)), batch_size=8))
        return {"steps": trainer.global_step, "warnings": [str(w.message) for w in caught]}

    return in_process(fit)


def lightning_warns_and_takes_no_step(ended: list[Ended], tmp: Path) -> None:
    out = ended[0].value
    assert out["steps"] == 0
    assert any("Total length of `DataLoader` across ranks is zero" in w for w in out["warnings"]), out["warnings"]


def interrupted_save(tmp: Path) -> list[Ended]:
    """The 3rd save of last.ckpt fails half-way (a full disk) inside a real fit."""
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] < 3:
            real_save(obj, f, *args, **kwargs)
            return
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    def fit() -> int:
        every_step = ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=0, every_n_train_steps=1)
        trainer = _trainer(
            "auto", 1, max_steps=4, callbacks=[every_step], enable_checkpointing=True, plugins=[AtomicCheckpointIO()]
        )
        torch.save = failing_save  # type: ignore[assignment]
        try:
            trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=8))
        finally:
            torch.save = real_save  # type: ignore[assignment]
        return trainer.global_step

    return in_process(fit)


def previous_last_checkpoint_resumes(ended: list[Ended], tmp: Path) -> None:
    last = tmp / "last.ckpt"
    assert sorted(p.name for p in tmp.iterdir()) == ["last.ckpt"] and not temp_files_of(last)
    assert AtomicCheckpointIO().load_checkpoint(last, weights_only=False)["global_step"] == 2
    trainer = _trainer("auto", 1, max_steps=4, plugins=[AtomicCheckpointIO()])
    trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=last)
    assert trainer.global_step == 4  # resumed at step 2, not from scratch
