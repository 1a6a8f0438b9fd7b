"""Batch-size scaling rules and gradual warmup for large-batch data-parallel training.

Goyal et al. (2017, *Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour*) keep accuracy as the global batch
(per-device batch x replicas x accumulate) grows by scaling the learning rate with it (``linear``, §2.1) and ramping
it up over the first epochs (§2.2, gradual warmup); adaptive optimizers (LAMB, You et al. 2020) usually pair with
``sqrt`` scaling (Krizhevsky 2014). Replicas are *data-parallel*: a pipeline's stages are not (:func:`replicas_of`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "SCALING_RULES",
    "LinearWarmup",
    "ScalingConfig",
    "ScalingPlan",
    "global_batch_size",
    "plan_scaling",
    "replicas_of",
    "scaled_lr",
]

SCALING_RULES: tuple[str, ...] = ("none", "linear", "sqrt")
DECAYS: tuple[str, ...] = ("none", "cosine", "step")


def _one_of(what: str, value: Any, names: tuple[str, ...], hint: str = "") -> None:
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(names)}{hint}")


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, found {value!r}; {fix}")
    return value


def _positive_float(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, found {value!r}; {fix}")
    return float(value)


def global_batch_size(per_device: int, *, replicas: int, accumulate: int = 1) -> int:
    """Samples per optimizer step: ``per_device x replicas x accumulate``, each a positive integer (else
    ``ValueError``); ``replicas`` are data-parallel (processes that see *different* samples)."""
    _positive_int("per-device batch size", per_device, "set data.batch_size to 1 or more")
    _positive_int("replicas", replicas, "a strategy has at least one data-parallel replica")
    _positive_int("accumulate", accumulate, "set trainer.accumulate_grad_batches to 1 or more")
    return per_device * replicas * accumulate


def scaled_lr(base_lr: float, *, base_batch_size: int, global_batch_size: int, rule: str) -> float:
    """The learning rate for ``global_batch_size`` given ``base_lr`` tuned at ``base_batch_size``.

    ``none`` keeps ``base_lr``; ``linear`` multiplies it by ``k = global/base`` (Goyal et al.), ``sqrt`` by ``sqrt(k)``.

    Raises:
        ValueError: for an unknown rule (the valid ones are listed) or non-positive inputs.
    """
    _one_of("scaling rule", rule, SCALING_RULES, " (set scaling=none|linear|sqrt)")
    lr = _positive_float("base lr", base_lr, "set optimizer.lr to a positive value")
    base = _positive_int("base batch size", base_batch_size, "set scaling.base_batch_size to 1 or more")
    glob = _positive_int("global batch size", global_batch_size, "check data.batch_size and devices")
    k = glob / base
    if rule == "linear":
        return lr * k
    if rule == "sqrt":
        return lr * math.sqrt(k)
    return lr


@dataclass(frozen=True)
class ScalingPlan:
    """How a run's global batch and learning rate were derived, for logs and ``metrics.json``.

    Attributes:
        global_batch: ``per_device x replicas x accumulate`` (data-parallel replicas, gradient-accumulation steps).
        base_lr: the configured lr, tuned at ``base_batch_size``.
        rule: ``none``, ``linear`` or ``sqrt``.
        lr: the scaled lr that training reaches after warmup.
        warmup_epochs: epochs of linear warmup from ``base_lr`` (or less) to ``lr``.
    """

    per_device: int
    replicas: int
    accumulate: int
    global_batch: int
    base_lr: float
    base_batch_size: int
    rule: str
    lr: float
    warmup_epochs: float

    def describe(self) -> str:
        """One line such as ``global batch 512 = 64 per device x 8 replicas x 1; lr 0.2 = 0.1 x 512/256 (linear)``."""
        factor = {
            "none": "",
            "linear": f" x {self.global_batch}/{self.base_batch_size}",
            "sqrt": f" x sqrt({self.global_batch}/{self.base_batch_size})",
        }[self.rule]
        text = (
            f"global batch {self.global_batch} = {self.per_device} per device x {self.replicas} "
            f"replicas x {self.accumulate}; lr {self.lr:.6g} = {self.base_lr:.6g}{factor} ({self.rule})"
        )
        if self.warmup_epochs > 0:
            text += f"; linear warmup from {self.base_lr:.6g} over {self.warmup_epochs:g} epochs"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_device_batch_size": self.per_device,
            "replicas": self.replicas,
            "accumulate_grad_batches": self.accumulate,
            "global_batch_size": self.global_batch,
            "base_lr": self.base_lr,
            "base_batch_size": self.base_batch_size,
            "scaling_rule": self.rule,
            "lr": self.lr,
            "warmup_epochs": self.warmup_epochs,
        }


def plan_scaling(
    *,
    base_lr: float,
    per_device: int,
    replicas: int,
    accumulate: int = 1,
    base_batch_size: int = 256,
    rule: str = "linear",
    warmup_epochs: float = 0.0,
) -> ScalingPlan:
    """Derive the global batch and scaled lr of a run; see :class:`ScalingPlan`."""
    glob = global_batch_size(per_device, replicas=replicas, accumulate=accumulate)
    lr = scaled_lr(base_lr, base_batch_size=base_batch_size, global_batch_size=glob, rule=rule)
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int | float) or warmup_epochs < 0:
        raise ValueError(f"warmup_epochs must be a number >= 0, found {warmup_epochs!r}; set scaling.warmup_epochs")
    return ScalingPlan(
        per_device, replicas, accumulate, glob, float(base_lr), base_batch_size, rule, lr, float(warmup_epochs)
    )


def replicas_of(strategy: Any) -> int:
    """Data-parallel replicas of a Lightning strategy: its ``distributed_sampler_kwargs["num_replicas"]``, the number
    of different data shards (a pipeline strategy reports its replicas there, not its stages), else 1."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if isinstance(kwargs, dict) and kwargs.get("num_replicas"):
        return int(kwargs["num_replicas"])
    return 1


class LinearWarmup(LRScheduler):
    """Gradual warmup (Goyal et al. §2.2), then an optional decay; stepped once per optimizer step.

    Args:
        optimizer: the wrapped optimizer, built with the *target* (scaled) lr: its groups' current ``lr``.
        warmup_steps: optimizer steps over which the lr grows linearly to the target (0: no warmup).
        start_factor: the first lr as a fraction of the target, in (0, 1], e.g. ``base_lr / scaled_lr``.
        decay: after warmup, ``"none"`` (constant), ``"cosine"`` (a half cosine to 0 at ``total_steps``) or
            ``"step"`` (times ``gamma`` at each of ``milestones``; Goyal's /10 at epochs 30, 60, 80).
        total_steps: steps of the whole run; needed for ``"cosine"``.
        milestones: steps (not epochs) at which ``"step"`` decays.
        gamma: the ``"step"`` decay factor.
        last_epoch: as in torch schedulers; -1 starts fresh.

    Raises:
        ValueError: an argument out of range, or ``"cosine"`` without ``total_steps > warmup_steps``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        warmup_steps: int,
        start_factor: float = 1.0,
        decay: str = "none",
        total_steps: int | None = None,
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, found {warmup_steps!r}")
        if not 0 < start_factor <= 1:
            raise ValueError(
                f"start_factor must be in (0, 1], found {start_factor!r}: warmup starts at or below the target lr"
            )
        _one_of("decay", decay, DECAYS)
        if decay == "cosine" and (total_steps is None or total_steps <= warmup_steps):
            raise ValueError(
                f"decay='cosine' needs total_steps > warmup_steps, found total_steps={total_steps!r}, "
                f"warmup_steps={warmup_steps}"
            )
        self.warmup_steps = warmup_steps
        self.start_factor = float(start_factor)
        self.decay = decay
        self.total_steps = total_steps
        self.milestones = sorted(int(m) for m in milestones)
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The lr multiplier at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.start_factor + (1.0 - self.start_factor) * step / self.warmup_steps
        if self.decay == "cosine":
            assert self.total_steps is not None
            progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return float(self.gamma ** sum(step >= m for m in self.milestones))
        return 1.0

    def get_lr(self) -> list[float]:  # type: ignore[override]
        f = self.factor(self.last_epoch)
        return [float(base) * f for base in self.base_lrs]


@dataclass(frozen=True)
class ScalingConfig:
    """A run's scaling rule and lr schedule, as configured (``conf/scaling/*.yaml``; ``ValueError`` if invalid).

    Attributes:
        rule: ``none``, ``linear`` (Goyal et al.) or ``sqrt`` (usual with LAMB).
        base_batch_size: the global batch the optimizer's lr was tuned at (256 in Goyal et al.).
        warmup_epochs: epochs (fractions allowed) of linear warmup from the base lr to the scaled lr (Goyal: 5).
        decay: after warmup, ``none`` (constant), ``cosine`` (to 0 at the end of training) or ``step``.
        milestones: epochs at which ``step`` decay multiplies the lr by ``gamma``.
        gamma: the ``step`` decay factor.
    """

    rule: str = "linear"
    base_batch_size: int = 256
    warmup_epochs: float = 0.0
    decay: str = "none"
    milestones: Sequence[int] = ()
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _one_of("scaling rule", self.rule, SCALING_RULES, " (set scaling=none|linear|sqrt)")
        _positive_int("scaling.base_batch_size", self.base_batch_size, "set it to the batch the lr was tuned at")
        if not isinstance(self.warmup_epochs, int | float) or self.warmup_epochs < 0:
            raise ValueError(f"scaling.warmup_epochs must be >= 0, found {self.warmup_epochs!r}")
        _one_of("scaling.decay", self.decay, DECAYS)
        if not 0 < self.gamma <= 1:
            raise ValueError(f"scaling.gamma must be in (0, 1], found {self.gamma!r}")
        object.__setattr__(self, "milestones", tuple(int(m) for m in self.milestones))

    def plan(self, *, base_lr: float, per_device: int, replicas: int, accumulate: int = 1) -> ScalingPlan:
        """The :class:`ScalingPlan` of a run with these settings."""
        return plan_scaling(
            base_lr=base_lr,
            per_device=per_device,
            replicas=replicas,
            accumulate=accumulate,
            base_batch_size=self.base_batch_size,
            rule=self.rule,
            warmup_epochs=self.warmup_epochs,
        )

    def scheduler(
        self, optimizer: Optimizer, plan: ScalingPlan, *, steps_per_epoch: int, total_steps: int
    ) -> LinearWarmup:
        """A per-step :class:`LinearWarmup` for ``optimizer`` (built with ``plan.lr``)."""
        _positive_int("steps_per_epoch", steps_per_epoch, "the train loader yields no full batch")
        warmup_steps = round(self.warmup_epochs * steps_per_epoch)
        return LinearWarmup(
            optimizer,
            warmup_steps=warmup_steps,
            start_factor=min(1.0, plan.base_lr / plan.lr),
            decay=self.decay,
            total_steps=max(total_steps, warmup_steps + 1),
            milestones=[m * steps_per_epoch for m in self.milestones],
            gamma=self.gamma,
        )
