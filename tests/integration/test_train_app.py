"""The training app end to end: recipes, accuracy, 2-process DDP, multirun, loggers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from app_utils import FEW_BATCHES, compose_cfg, config_options, run_train

from recipes.train import run

pytestmark = pytest.mark.slow


def _tree(root: Path, classes: int = 3) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in range(classes):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(4):
                Image.new("RGB", (20, 20), color=(60 * c, 20 * i, 0)).save(root / split / f"c{c}" / f"{i}.png")


RECIPE_SMALL = {
    # each recipe as written, shrunk to seconds: tiny images/width, a few batches
    "digits_resnet": [],
    "resnet50_synthetic": ["data.image_size=32", "data.num_samples=64", "data.batch_size=8", "model.width=8"],
    "resnet50_imagenet_goyal": ["data.image_size=32", "global_batch_size=4", "model.width=8", "data.num_workers=0",
                                "data.prefetch_factor=null", "data.persistent_workers=false",
                                "data.pin_memory=false"],
    "resnet50_imagenet_lamb": ["data.image_size=32", "global_batch_size=4", "model.width=8", "data.num_workers=0",
                               "data.prefetch_factor=null", "data.persistent_workers=false",
                               "data.pin_memory=false"],
}


# Recipes of several processes run as `python train.py` does, through Lightning's own launcher (which
# re-runs the command line for the other ranks, so not in the pytest process): rank 0 fits and then
# tests in one process. For digits_wide_mlp that is the path where a stale DTensor mesh once failed.
MULTI_PROCESS = {"digits_wide_mlp"}


@pytest.mark.parametrize("recipe", config_options("recipe"))
def test_every_recipe_runs_a_few_batches(recipe: str, tmp_path: Path) -> None:
    overrides = [f"recipe={recipe}", *FEW_BATCHES, *RECIPE_SMALL.get(recipe, [])]
    if "imagenet" in recipe:
        _tree(tmp_path / "data")
        overrides.append(f"data.root={tmp_path / 'data'}")
    out = tmp_path / "run"
    if recipe in MULTI_PROCESS:
        done = run_train([*overrides, f"hydra.run.dir={out}"], cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        metrics = json.loads((out / "metrics.json").read_text())
    else:
        metrics = run(compose_cfg(overrides, output_dir=out))
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["status"] == "ok" and saved["steps"] == 2
    for key in ("test_acc", "val_acc", "train_loss", "samples_per_s", "global_batch_size", "lr", "strategy",
                "world_size", "wall_s"):
        assert key in saved, key
    assert metrics["global_batch_size"] == saved["global_batch_size"]
    assert (out / "csv").is_dir()


def test_goyal_recipe_derives_per_device_batch(tmp_path: Path) -> None:
    _tree(tmp_path / "data")
    cfg = compose_cfg(
        ["recipe=resnet50_imagenet_goyal", f"data.root={tmp_path / 'data'}", *FEW_BATCHES,
         *RECIPE_SMALL["resnet50_imagenet_goyal"], "global_batch_size=6", "trainer.accumulate_grad_batches=2"],
        output_dir=tmp_path / "run",
    )
    metrics = run(cfg)
    # 6 = 3 per device x 1 replica x 2 accumulation; lr 0.1 x 6/256 (linear)
    assert metrics["per_device_batch_size"] == 3 and metrics["global_batch_size"] == 6
    assert metrics["lr"] == pytest.approx(0.1 * 6 / 256)


def test_digits_default_reaches_95_percent(tmp_path: Path) -> None:
    """`python train.py` as a user runs it (a fresh interpreter): the digits recipe, single CPU process."""
    proc = run_train(["hydra.run.dir=run", "trainer.enable_progress_bar=false"], cwd=tmp_path, timeout=300, fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_acc"] >= 0.95, metrics
    # the first validation at >= 95% comes after some training and before the end of the run
    assert metrics["val_acc_by_epoch"][-1] >= 0.95
    assert 0 < metrics["seconds_to_val_acc_95"] < metrics["wall_s"]
    assert metrics["strategy"] == "single" and metrics["world_size"] == 1
    assert "metrics: " in proc.stdout and "test_acc" in proc.stdout  # the human summary
    assert "global batch 64 = 64 per device x 1 replicas x 1; lr 0.05" in proc.stdout + proc.stderr


def test_ddp_sim_runs_two_processes(tmp_path: Path) -> None:
    proc = run_train(["trainer=ddp_sim", "hydra.run.dir=run", *FEW_BATCHES], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["strategy"] == "ddp"
    # lr scaled for 2 replicas: 0.05 x 128/64
    assert metrics["global_batch_size"] == 128 and metrics["lr"] == pytest.approx(0.1)


def test_multirun_one_dir_per_job_and_a_summary(tmp_path: Path) -> None:
    proc = run_train(
        ["-m", "trainer=ddp_sim", "optimizer.lr=0.05,0.1", "hydra.sweep.dir=sweep", *FEW_BATCHES],
        cwd=tmp_path,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2  # no child process re-ran the sweep (that would make 4+ dirs)
    lrs = sorted(json.loads((j / "metrics.json").read_text())["lr"] for j in jobs)
    assert lrs == pytest.approx([0.1, 0.2])  # 0.05 and 0.1 at 64, scaled to 128
    assert proc.stdout.count("Launching 2 jobs locally") + proc.stderr.count("Launching 2 jobs locally") == 1
    summary = (sweep / "summary.md").read_text()
    assert "| optimizer.lr |" in summary.replace("job | ", "") and summary.count("| ok |") == 2
    assert (sweep / "test_acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multirun_failed_job_is_a_failed_row(tmp_path: Path) -> None:
    proc = run_train(
        ["-m", "optimizer.lr=0.05,-1", "hydra.sweep.dir=sweep", *FEW_BATCHES], cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 1  # the sweep finishes, then reports the failure in its exit code
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert summary.count("| ok |") == 1 and summary.count("| failed |") == 1
    assert "optimizer.lr must be a positive number, found -1" in summary
    for name in ("test_acc.png", "wall_s.png"):  # the plots, the failed job an empty bar
        assert (tmp_path / "sweep" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in summary


def test_tensorboard_logger(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(compose_cfg(["logger=tensorboard", "model=small_cnn", *FEW_BATCHES], output_dir=out))
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    # the composed config is the run's hyperparameters (TensorBoard's HPARAMS tab, and hparams.yaml)
    assert any(b"optimizer/lr" in e.read_bytes() and b"_hparams_/session_start_info" in e.read_bytes() for e in events)
    hparams = yaml.safe_load(next((out / "tensorboard").rglob("hparams.yaml")).read_text())
    assert hparams["optimizer"]["lr"] == 0.05 and hparams["model"]["name"] == "small_cnn"


def test_callbacks_removed_from_the_command_line(tmp_path: Path) -> None:
    # conf/callbacks/default.yaml: without the throughput monitor the run trains and its numbers are
    # null (n/a), not invented; without the checkpoint callback Lightning must not add its own
    out = tmp_path / "run"
    overrides = ["~callbacks.throughput_monitor", "~callbacks.model_checkpoint", "model=small_cnn", *FEW_BATCHES]
    metrics = run(compose_cfg(overrides, output_dir=out))
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["status"] == "ok" and saved["steps"] == 2 and saved["test_acc"] is not None
    for key in ("samples_per_s", "samples_per_s_by_epoch", "val_acc_by_epoch", "seconds_to_val_acc_95"):
        assert key in saved and saved[key] is None and metrics[key] is None, key
    assert not list(out.rglob("*.ckpt"))
    assert any(key.startswith("lr-SGD") for key in saved)  # the learning-rate monitor still ran
