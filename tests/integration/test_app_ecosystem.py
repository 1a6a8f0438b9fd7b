"""The app with the ecosystem's usual tools: an Optuna search, submitit jobs, your own module and
data, the report installed and run from anywhere, hyperparameters and comm metrics in the logs."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from app_utils import FEW_BATCHES, ROOT, run_train

pytestmark = pytest.mark.slow

SMALL = ["model=small_cnn", *FEW_BATCHES]


def _metrics(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("[0-9]*/metrics.json"))]


def test_optuna_search_runs_three_trials_and_picks_the_best(tmp_path: Path) -> None:
    proc = run_train(
        ["hparams_search=digits_optuna", "hydra.sweeper.n_trials=3", "hydra.sweep.dir=sweep", *SMALL],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = _metrics(tmp_path / "sweep")
    assert len(trials) == 3 and all(t["status"] == "ok" for t in trials)
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    # train.py returned each trial's val_acc (optimized_metric); the sweeper maximised it
    assert best["best_value"] == pytest.approx(max(t["val_acc"] for t in trials))
    assert set(best["best_params"]) == {"optimizer.lr", "optimizer.weight_decay", "data.batch_size"}
    assert (tmp_path / "sweep" / "summary.md").read_text().count("| ok |") == 3


def test_submitit_local_sweep_starts_each_jobs_ranks(tmp_path: Path) -> None:
    proc = run_train(
        ["-m", "hydra/launcher=submitit_local", "trainer=ddp_sim", "strategy=ring", "optimizer.lr=0.05,0.1",
         "hydra.sweep.dir=sweep", *SMALL],
        cwd=tmp_path,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = _metrics(tmp_path / "sweep")
    assert [(j["status"], j["world_size"], j["strategy"]) for j in jobs] == [("ok", 2, "ring")] * 2
    assert sorted(j["lr"] for j in jobs) == pytest.approx([0.1, 0.2])  # scaled for 2 ranks
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "2 jobs, 2 ok" in summary and "| optimizer.lr |" in summary.replace("job | ", "")


def test_submitit_local_failing_job_fails_the_sweep(tmp_path: Path) -> None:
    proc = run_train(
        ["-m", "hydra/launcher=submitit_local", "optimizer.lr=0.05,-1", "hydra.sweep.dir=sweep", *SMALL],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "2 jobs, 1 ok" in summary and summary.count("| failed |") == 1
    assert "optimizer.lr must be a positive number, found -1" in summary


def test_own_module_and_data_train_under_ring_with_hparams_and_comm_metrics_logged(tmp_path: Path) -> None:
    """examples/byo: a LightningModule and a DataModule written outside the package, through _target_."""
    example = ROOT / "examples" / "byo"
    # 3 steps per epoch, fewer than log_every_n_steps (10): comm metrics reach the log at each epoch's end
    proc = run_train(
        ["--config-dir", str(example / "conf"), "recipe=blobs_mlp", "trainer=ddp_sim", "strategy=ring",
         "trainer.max_epochs=2", "+trainer.limit_train_batches=3", "trainer.enable_progress_bar=false",
         "hydra.run.dir=run"],
        cwd=tmp_path,
        timeout=300,
        extra_paths=(example,),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["status"], metrics["strategy"], metrics["world_size"]) == ("ok", "ring", 2)
    # the module got the scaled lr (0.05 at 32 -> 0.1 at 2 x 32) and trained
    assert metrics["lr"] == pytest.approx(0.1) and metrics["val_acc"] > 0.5 and "val_loss" in metrics
    hparams = yaml.safe_load((run / "csv" / "version_0" / "hparams.yaml").read_text())
    assert hparams["optimizer"]["lr"] == 0.05 and hparams["model"]["_target_"] == "my_project.MLPClassifier"
    assert hparams["plan"]["lr"] == pytest.approx(0.1) and hparams["hidden"] == 64  # the module's own, merged
    rows = list(csv.DictReader((run / "csv" / "version_0" / "metrics.csv").open()))
    comm_steps = [int(r["step"]) for r in rows if r.get("comm/bytes_sent")]
    assert comm_steps == [2, 5], rows  # the last step of each epoch (0-based)


def test_report_installed_runs_from_another_directory(tmp_path: Path) -> None:
    # the package as pip installs it (a wheel), not the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("lightning_strategies", "recipes"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stderr
    assert "deprecat" not in (built.stdout + built.stderr).lower()  # license as an SPDX string
    site = tmp_path / "site"
    wheel = next((tmp_path / "dist").glob("*.whl"))
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=180)
    assert installed.returncode == 0, installed.stderr
    sweep = tmp_path / "elsewhere" / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.1\n")
    (sweep / "0" / "metrics.json").write_text(json.dumps({"status": "ok", "test_acc": 0.9}))
    env = {"PYTHONPATH": str(site), "PATH": str(Path(sys.executable).parent), "MPLBACKEND": "Agg"}
    for command in ([str(site / "bin" / "ls-report"), "sweep"], [sys.executable, "-m", "recipes.report", "sweep"]):
        (sweep / "summary.md").unlink(missing_ok=True)
        proc = subprocess.run(command, cwd=sweep.parent, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "sweep summary:" in proc.stdout and (sweep / "summary.md").exists()
