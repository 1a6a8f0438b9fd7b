"""Scaling rules and warmup against the formulas of Goyal et al. 2017 (§2.1, §2.2)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_strategies.scaling import (
    LinearWarmup,
    ScalingConfig,
    global_batch_size,
    plan_scaling,
    replicas_of,
    scaled_lr,
)


def test_global_batch_is_product() -> None:
    assert global_batch_size(64, replicas=8) == 512
    assert global_batch_size(32, replicas=256, accumulate=1) == 8192
    assert global_batch_size(16, replicas=3, accumulate=4) == 192


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("none", 0.1), ("linear", 0.1 * 8192 / 256), ("sqrt", 0.1 * math.sqrt(8192 / 256))],
)
def test_scaled_lr_rules(rule: str, expected: float) -> None:
    assert scaled_lr(0.1, base_batch_size=256, global_batch_size=8192, rule=rule) == pytest.approx(expected)


def test_goyal_lr_is_3_2_at_8k() -> None:
    # Goyal et al.: "lr = 0.1 * kn/256" -> 3.2 for kn = 8192.
    assert scaled_lr(0.1, base_batch_size=256, global_batch_size=8192, rule="linear") == pytest.approx(3.2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "cubic"}, "unknown scaling rule 'cubic'; expected one of none, linear, sqrt"),
        ({"base_lr": 0.0}, "base lr must be a positive finite number, found 0.0"),
        ({"base_lr": -1.0}, "found -1.0"),
        ({"base_lr": float("nan")}, "positive finite"),
        ({"base_batch_size": 0}, "base batch size must be a positive integer, found 0"),
        ({"global_batch_size": 0}, "global batch size must be a positive integer, found 0"),
    ],
)
def test_scaled_lr_rejects(kwargs: dict, message: str) -> None:
    args = {"base_lr": 0.1, "base_batch_size": 256, "global_batch_size": 512, "rule": "linear", **kwargs}
    base_lr = args.pop("base_lr")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scaled_lr(base_lr, **args)


@pytest.mark.parametrize(("per_device", "replicas", "acc"), [(0, 1, 1), (8, 0, 1), (8, 1, 0), (2.5, 1, 1)])
def test_global_batch_rejects(per_device: int, replicas: int, acc: int) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        global_batch_size(per_device, replicas=replicas, accumulate=acc)


def test_plan_describes_derivation() -> None:
    plan = plan_scaling(
        base_lr=0.1, per_device=64, replicas=8, accumulate=1, base_batch_size=256, rule="linear"
    )
    assert plan.global_batch == 512 and plan.lr == pytest.approx(0.2)
    assert (
        plan.describe()
        == "global batch 512 = 64 per device x 8 replicas x 1; lr 0.2 = 0.1 x 512/256 (linear)"
    )
    assert plan.as_dict()["global_batch_size"] == 512


def _lrs(scheduler: LinearWarmup, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_warmup_goes_linearly_from_base_to_scaled_lr() -> None:
    # Goyal §2.2: start at lr eta, add a constant each iteration, reach k*eta after warmup.
    base, target, warmup = 0.1, 0.8, 7
    opt = _optimizer(target)
    sched = LinearWarmup(opt, warmup_steps=warmup, start_factor=base / target)
    lrs = _lrs(sched, opt, 10)
    expected = [base + (target - base) * i / warmup for i in range(warmup)] + [target] * 3
    assert lrs == pytest.approx(expected)
    increments = {round(b - a, 12) for a, b in itertools.pairwise(lrs[: warmup + 1])}
    assert len(increments) == 1  # constant increment per iteration


def test_cosine_and_step_decay() -> None:
    opt = _optimizer(1.0)
    lrs = _lrs(LinearWarmup(opt, warmup_steps=2, start_factor=0.5, decay="cosine", total_steps=10), opt, 11)
    assert lrs[:2] == pytest.approx([0.5, 0.75])
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lrs[10] == pytest.approx(0.0, abs=1e-12)
    opt = _optimizer(1.0)
    lrs = _lrs(LinearWarmup(opt, warmup_steps=0, decay="step", milestones=[3, 5], gamma=0.1), opt, 7)
    assert lrs == pytest.approx([1, 1, 1, 0.1, 0.1, 0.01, 0.01])


def test_warmup_resumes_from_state_dict() -> None:
    opt = _optimizer(1.0)
    sched = LinearWarmup(opt, warmup_steps=10, start_factor=0.1)
    _lrs(sched, opt, 4)
    state = sched.state_dict()
    opt2 = _optimizer(1.0)
    sched2 = LinearWarmup(opt2, warmup_steps=10, start_factor=0.1)
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert _lrs(sched2, opt2, 3) == pytest.approx(_lrs(sched, opt, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"warmup_steps": 2, "start_factor": 0.0}, r"start_factor must be in \(0, 1\]"),
        ({"warmup_steps": 2, "decay": "linear"}, "unknown decay 'linear'"),
        ({"warmup_steps": 2, "decay": "cosine"}, "needs total_steps > warmup_steps"),
    ],
)
def test_warmup_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinearWarmup(_optimizer(1.0), **kwargs)


def test_scaling_config_builds_plan_and_scheduler() -> None:
    cfg = ScalingConfig(rule="linear", base_batch_size=64, warmup_epochs=2, decay="step", milestones=[3])
    plan = cfg.plan(base_lr=0.05, per_device=64, replicas=2)
    assert plan.lr == pytest.approx(0.1)
    opt = _optimizer(plan.lr)
    sched = cfg.scheduler(opt, plan, steps_per_epoch=5, total_steps=25)
    lrs = _lrs(sched, opt, 20)
    assert lrs[0] == pytest.approx(0.05)  # warmup starts at the base lr
    assert lrs[10] == pytest.approx(0.1)  # warmup over 2 epochs x 5 steps
    assert lrs[15] == pytest.approx(0.01)  # /10 at epoch 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "log"}, "unknown scaling rule 'log'"),
        ({"base_batch_size": 0}, "scaling.base_batch_size must be a positive integer"),
        ({"warmup_epochs": -1}, "warmup_epochs must be >= 0"),
        ({"decay": "exp"}, "unknown scaling.decay 'exp'"),
        ({"gamma": 0}, "gamma must be in"),
    ],
)
def test_scaling_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**kwargs)


def test_replicas_of_reads_sampler_kwargs() -> None:
    class Pipeline:  # 8 processes as 2 replicas x 4 stages: the sampler shards over 2
        def __init__(self) -> None:
            self.distributed_sampler_kwargs = {"num_replicas": 2, "rank": 1}

    assert replicas_of(Pipeline()) == 2
    assert replicas_of(object()) == 1


def test_recipe_module_refuses_a_plan_of_another_trainer() -> None:
    # recipes.train.run derives the plan once and hands it to the module: a plan made for other
    # replicas would silently train at the wrong lr, so the module compares before using it
    from recipes.classification import _check_plan_fits

    plan = ScalingConfig(rule="linear", base_batch_size=64).plan(base_lr=0.05, per_device=64, replicas=2)
    _check_plan_fits(plan, per_device=64, replicas=2, accumulate=1)
    _check_plan_fits(plan, per_device=0, replicas=2, accumulate=1)  # no DataModule: batch unknown
    with pytest.raises(ValueError, match=r"derived for 64 per device x 2 replicas x 1 .* runs 64 x 4 x 1"):
        _check_plan_fits(plan, per_device=64, replicas=4, accumulate=1)
