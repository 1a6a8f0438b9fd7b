"""The app's words, its checks before anything starts, and the thread count it picks (issue 27)."""

from __future__ import annotations

import pytest
from app_utils import compose_cfg, config_options

from lightning_strategies._errors import ddp_options_set
from recipes.checks import check_missing_values, check_strategy_options, threads_per_process
from recipes.failures import _child_error, _message, app_message


def test_library_words_become_the_apps_options() -> None:
    text = app_message(
        "ParameterServerStrategy found Trainer(gradient_clip_val=1.0): ... Expected gradient_clip_val=None. "
        "Fix: pass another checkpoint as ckpt_path (or start without ckpt_path), or max_grad_norm=None."
    )
    assert "found trainer.gradient_clip_val=1.0:" in text and "Expected trainer.gradient_clip_val=null." in text
    assert "as resume=<path to the .ckpt>" in text and "start fresh with resume=null" in text
    assert "ckpt_path" not in text and "None" not in text and "max_grad_norm=null" in text


def test_a_peer_note_that_repeats_the_error_is_dropped() -> None:
    err = ValueError("batch 64 is not divisible by 5. Fix: change microbatches")
    err.add_note("pipeline: peer rank 1 of 2 stopped on an error: ValueError: batch 64 is not divisible by 5. Fix: "
                 "change microbatches")
    err.add_note("pipeline: lost peer rank 3 of 4: no heartbeat")
    assert _message(err) == ("ValueError: batch 64 is not divisible by 5. Fix: change microbatches\n"
                             "pipeline: lost peer rank 3 of 4: no heartbeat")


def test_a_fork_childs_traceback_becomes_its_error() -> None:
    text = ('\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n  File "x.py", '
            'line 1, in f\n    raise ValueError("bad")\nValueError: bad. Fix: good\nnote line\n')
    assert _child_error(text) == "ValueError: bad. Fix: good\nnote line"
    assert _child_error("no traceback here") is None


@pytest.mark.parametrize("strategy", config_options("strategy"))
def test_every_strategy_config_passes_the_option_check(strategy: str) -> None:
    cfg = compose_cfg([f"strategy={strategy}"])
    check_strategy_options(cfg)
    check_missing_values(cfg)


def test_an_option_the_strategy_does_not_take_is_refused_with_its_options() -> None:
    with pytest.raises(ValueError, match=r"found option num_servers, which it does not take") as info:
        check_strategy_options(compose_cfg(["strategy=ring", "+strategy.num_servers=2"]))
    assert "bucket_cap_mb" in str(info.value) and "ParameterServerStrategy" in str(info.value)
    # DDP's wrapper options are a ring's options too
    check_strategy_options(compose_cfg(["strategy=ring", "+strategy.find_unused_parameters=true"]))


def test_a_missing_root_names_the_key_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"data.root: found no value .*Fix: pass data.root="):
        check_missing_values(compose_cfg(["data=imagefolder"]))


@pytest.mark.parametrize(("busy", "processes", "threads"), [(0.0, 1, 2), (2.0, 1, 1), (1.0, 1, 1), (0.0, 2, 1),
                                                            (9.0, 4, 1)])
def test_threads_are_the_free_cores_shared_out(busy: float, processes: int, threads: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert threads_per_process(processes, busy) == threads


def test_ddp_options_a_cli_fills_in_at_their_defaults_are_not_settings() -> None:
    allowed = {"timeout", "start_method"}
    filled = {"find_unused_parameters": False, "static_graph": False, "broadcast_buffers": None, "ddp_comm_hook": None,
              "bucket_cap_mb": None, "timeout": 5}
    assert ddp_options_set(filled, allowed) == []
    assert ddp_options_set({**filled, "find_unused_parameters": True, "other": 1}, allowed) == [
        "find_unused_parameters", "other"]
