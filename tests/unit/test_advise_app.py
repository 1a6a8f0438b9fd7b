"""``python -m recipes.advise`` / ``ls-advise`` on a recipe, and ``strategy=advised`` in the app."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from app_utils import compose_cfg
from hydra.utils import instantiate
from lightning.pytorch.strategies import Strategy

from lightning_strategies.advisor.report import JSON_KEYS
from recipes.advise import ENV, advice_for, main

WIDE = ["recipe=digits_wide_mlp", "model.width=256", "data.batch_size=32"]


def test_the_cli_prints_the_table_writes_the_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "advice.png"
    assert main([*WIDE, "cluster=emulated_2x2_50mbit", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "emulated_2x2_50mbit: 2 x 2" in out and "first choice: python train.py strategy=" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main([*WIDE, "cluster=loopback", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["name"] == "loopback" and data["batch_per_device"] == 32
    # 64 -> 256 -> 256 -> 256 -> 10 in float32, SGD with momentum (conf/optimizer/sgd.yaml): one buffer per weight
    params = 4 * (64 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10)
    assert data["measured"]["params"] == params and data["measured"]["optimizer_state"] == params
    assert [set(r) for r in data["strategies"]] == [set(JSON_KEYS)] * 13
    # every strategy but local_sgd and diloco ranked (theirs is a different optimisation): ddp ... tensor, ft
    assert sorted(r["rank"] for r in data["strategies"] if r["rank"]) == list(range(1, 12))
    unranked = {r["name"]: r for r in data["strategies"] if not r["rank"]}
    assert set(unranked) == {"local_sgd", "diloco"} and all(r["fits"] for r in unranked.values())
    assert unranked["diloco"]["options"] == {"sync_every": 100}


def test_a_model_that_fits_nowhere_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WIDE, "cluster=loopback", "cluster.device_memory_gib=0.0001", "--json"]) == 1
    err = capsys.readouterr().err
    assert "Error: no strategy fits this model on loopback" in err and "expected at most 0.0001 GiB" in err
    assert main(["--nope"]) == 2


def test_the_cli_helps_and_refuses_bad_options_and_configs_in_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = Path(__file__).resolve().parents[2] / "conf"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ls-advise")
    for kind in ("recipe", "cluster"):  # every preset, by name
        names = sorted(p.stem for p in (conf / kind).glob("*.yaml"))
        assert len(names) >= 5 and f"({conf.name}/{kind}): {', '.join(names)}" in out
    # a flag without its value: refused before anything is measured or written (it once wrote a file ".png")
    assert main([*WIDE, "cluster=loopback", "--png"]) == 2
    err = capsys.readouterr().err
    assert "Error: argument --png: expected one argument. Fix: ls-advise --help" in err
    assert main(["--nope", *WIDE]) == 2
    assert "Error: unrecognized arguments: --nope." in capsys.readouterr().err
    # an unknown preset: Hydra's list of the available ones, without a traceback or its search path
    assert main(["recipe=nope", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: In 'train': Could not find 'recipe/nope'") and "digits_wide_mlp" in err
    assert "Traceback" not in err and "Config search path" not in err
    assert main([*WIDE, "cluster=loopback", "cluster.nope=1"]) == 2
    assert "Could not override 'cluster.nope'" in capsys.readouterr().err
    # options between the overrides, and --png=PATH
    png = tmp_path / "a.png"
    assert main(["--png=" + str(png), "recipe=digits_wide_mlp", "--json", "model.width=64", "cluster=loopback"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["name"] == "loopback" and not png.exists()  # JSON: no PNG


def test_strategy_advised_composes_and_builds_the_first_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    # compute from a stated throughput (FLOPs / tflops), not timed: the advisor's two runs below see the same
    # step, so their first choices agree (timed, ring_bf16 and pipeline came within 0.4% here: either could lead)
    cfg = compose_cfg([*WIDE, "strategy=advised", "cluster=emulated_4x1_1gbit", "+cluster.tflops=0.05"])
    assert cfg.cluster.name == "emulated_4x1_1gbit" and cfg.strategy.model.width == 256
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, Strategy)
    chosen = json.loads(os.environ[ENV])
    # the same advice computed directly: the same first choice
    best = advice_for(cluster=cfg.cluster, model=cfg.model, data=cfg.data, optimizer=cfg.optimizer).best()
    assert chosen["name"] == best.name
    # a rank started by the launcher reuses the launching process's choice instead of measuring again
    monkeypatch.setenv(ENV, json.dumps({**chosen, "name": "ps1", "options": {"num_servers": 1}}))
    assert type(instantiate(cfg.strategy)).__name__ == "ParameterServerStrategy"
