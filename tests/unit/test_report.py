"""The sweep report: one row per job (failed ones too), swept keys as columns, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.report import _layout, collect, main, swept_keys, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _job(root: Path, name: str, metrics: dict | None, overrides: list[str]) -> None:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))


def test_report_rows_columns_and_plots(tmp_path: Path) -> None:
    ok = {"status": "ok", "test_acc": 0.97, "samples_per_s": 300.0, "lr": 0.1, "wall_s": 30.0}
    ring = {**ok, "comm/bytes_sent": 2.8e6, "seconds_to_val_acc_95": 12.5}
    _job(tmp_path, "0", ring, ["strategy=ring", "trainer=ddp_sim"])
    _job(tmp_path, "1", ok, ["strategy=ddp", "trainer=ddp_sim"])
    _job(tmp_path, "2", {"status": "failed", "error": "ValueError: boom"}, ["strategy=ps", "trainer=ddp_sim"])
    _job(tmp_path, "3", None, ["strategy=async", "trainer=ddp_sim"])
    rows = collect(tmp_path)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert swept_keys(rows) == ["strategy"]  # trainer=ddp_sim is common to all jobs
    summary = write_report(tmp_path).read_text()
    assert "| job | strategy | status |" in summary
    assert summary.count("| ok |") == 2 and summary.count("| failed |") == 2
    assert "ValueError: boom" in summary and "no metrics.json" in summary
    assert "s to 95% val" in summary and "| 12.5 |" in summary
    for name in ("test_acc.png", "samples_per_s.png", "comm_bytes_sent.png", "seconds_to_val_acc_95.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG and f"]({name})" in summary


def test_report_cli_and_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _job(tmp_path, "0", {"status": "ok", "test_acc": 0.5}, ["optimizer.lr=0.1"])
    assert main([str(tmp_path)]) == 0
    assert "sweep summary:" in capsys.readouterr().out
    # the CLI: one message on stderr, exit 1 (no traceback); write_report itself raises
    assert main([str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"Error: sweep directory {str(tmp_path / 'nope')!r} does not exist") and "Fix: pass" in err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    assert "no job directories with metrics.json or .hydra/ below" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")


def test_report_groups_by_two_swept_keys(tmp_path: Path) -> None:
    # optimizer=sgd,lamb data.batch_size=32,128 as Hydra numbers it: the cartesian product in order
    combos = [("sgd", "32"), ("sgd", "128"), ("lamb", "32"), ("lamb", "128")]
    for i, (opt, batch) in enumerate(combos):
        metrics = {"status": "ok", "test_acc": 0.9 + i / 100, "samples_per_s": 100.0 * (i + 1)}
        _job(tmp_path, str(i), metrics, [f"optimizer={opt}", f"data.batch_size={batch}"])
    rows = collect(tmp_path)
    keys = swept_keys(rows)
    assert keys == ["optimizer", "data.batch_size"]
    # the last key along the axis, one series per value of the others
    ticks, series, where = _layout(rows, keys)
    assert ticks == ["32", "128"] and series == ["sgd", "lamb"]
    assert where == [(0, 0), (1, 0), (0, 1), (1, 1)]
    summary = write_report(tmp_path).read_text()
    assert "swept: optimizer, data.batch_size" in summary
    assert "| job | optimizer | data.batch_size | status |" in summary
    assert "| 2 | lamb | 32 | ok | 0.92 |" in summary
    for name in ("test_acc.png", "samples_per_s.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_report_orders_jobs_numerically_and_says_not_reached(tmp_path: Path) -> None:
    for i in range(11):  # "10" sorts before "2" as text
        metrics = {"status": "ok", "test_acc": 0.5, "val_acc_by_epoch": [0.4, 0.5], "seconds_to_val_acc_95": None}
        if i == 0:
            metrics.update(val_acc_by_epoch=[0.9, 0.96], seconds_to_val_acc_95=3.0)
        _job(tmp_path, str(i), metrics, [f"optimizer.lr={i}"])
    rows = collect(tmp_path)
    assert [r["job"] for r in rows] == [str(i) for i in range(11)]
    summary = write_report(tmp_path).read_text()
    assert summary.count("| not reached |") == 10 and "| 3 |" in summary
