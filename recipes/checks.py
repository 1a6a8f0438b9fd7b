"""Checks of the composed config that run before anything is built or any process starts, and the
torch thread count the app picks for a machine that others use too."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "busy_cores",
    "check_missing_values",
    "check_strategy_options",
    "choose_threads",
    "strategy_options",
    "threads_per_process",
]

# What a value the config leaves open (???) needs; keys not listed get the general advice.
_MISSING_HINTS = {
    "data.root": "an ImageFolder tree with train/<class>/* and val/<class>/* (ImageNet's layout), e.g. "
    "data.root=/datasets/imagenet",
}


# DDP options worth naming in a message; the full list is DDPStrategy's and DistributedDataParallel's signatures
_DDP_EXAMPLES = ("start_method", "process_group_backend", "find_unused_parameters", "static_graph",
                 "gradient_as_bucket_view")


def check_missing_values(cfg: DictConfig) -> None:
    """Refuse a config that leaves a required value open (``???``), naming it and how to set it.

    Raises:
        ValueError: for the first such key (OmegaConf's ``MissingMandatoryValue`` has no fix in it).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        hint = _MISSING_HINTS.get(key, f"{key}=<value>")
        others = f" (also open: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ValueError(
            f"{key}: found no value (??? in the config){others}: expected {hint}. Fix: pass {key}=... on the "
            "command line, or set it in your recipe"
        )


def strategy_options(cls: type) -> tuple[list[str], list[str]] | None:
    """The keyword options of strategy class ``cls``: (its own, those of the Lightning / torch DDP
    classes it passes the rest to); None when it takes ``**kwargs`` this cannot follow."""
    own: list[str] = []
    inherited: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names = [p.name for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        (inherited if klass is DDPStrategy else own).extend(n for n in names if n not in own + inherited)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return own, inherited
        if klass is DDPStrategy:  # its **kwargs go to DistributedDataParallel, when the model is wrapped in it
            if getattr(cls, "wraps_ddp", True):
                wrapper = inspect.signature(DistributedDataParallel.__init__).parameters
                inherited.extend(n for n in wrapper if n not in ("self", "module", "process_group", "device_ids"))
            return own, inherited
    return None


def check_strategy_options(cfg: DictConfig) -> None:
    """Refuse ``strategy.<key>`` options that the strategy class does not take, before it is built.

    A ring strategy passes options it does not know on to DDP's wrapper, which refuses them only
    once the processes have started; this says so at once and lists the strategy's options.

    Raises:
        ValueError: for options the class does not take.
    """
    node = cfg.get("strategy")
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return
    try:
        cls = get_object(node._target_)
    except Exception:  # Hydra's own error (which names the target) comes when it is built
        return
    options = strategy_options(cls) if isinstance(cls, type) else None
    if options is None:
        return
    own, inherited = options
    unknown = [k for k in node if isinstance(k, str) and not k.startswith("_") and k not in own + inherited]
    if not unknown:
        return
    choice = HydraConfig.get().runtime.choices.get("strategy") if HydraConfig.initialized() else None
    name = f"strategy={choice} ({cls.__name__})" if choice else f"strategy._target_={node._target_}"
    others = sorted(_classes_taking(unknown[0]) - {cls.__name__})
    elsewhere = f"; {unknown[0]} is an option of {', '.join(others)}" if others else ""
    refs = " ".join(f"~strategy.{k}" for k in unknown)
    examples = ", ".join(n for n in _DDP_EXAMPLES if n in inherited)
    raise ValueError(
        f"{name}: found option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}, which it does not take: expected "
        f"its own options ({', '.join(own) or 'none'})"
        + (f" or those it passes on to Lightning's DDPStrategy and torch's DistributedDataParallel ({examples}, ...)"
           if inherited else "")
        + f". Fix: drop {', '.join(unknown)} (remove the +strategy... override, or {refs}){elsewhere}"
    )


def _classes_taking(option: str) -> set[str]:
    import lightning_strategies

    found = set()
    for name in lightning_strategies.__all__:
        obj = getattr(lightning_strategies, name)
        if isinstance(obj, type) and name.endswith("Strategy") and option in (strategy_options(obj) or ([], []))[0]:
            found.add(name)
    return found


def _cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat (Linux), or None."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0.0), sum(fields[:8])


def busy_cores(window_s: float = 0.3) -> float:
    """How many cores other work keeps busy now: measured over ``window_s`` from /proc/stat, else the
    1-minute load average (which lags a load that just started by about a minute)."""
    before = _cpu_times()
    if before is not None:
        time.sleep(window_s)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            cores = os.cpu_count() or 1
            return cores * (1.0 - (after[0] - before[0]) / (after[1] - before[1]))
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this OS: assume the cores are free
        return 0.0


def threads_per_process(processes: int, busy: float | None = None) -> int:
    """Torch threads for each of ``processes`` CPU processes: the cores not busy with other work
    (``busy``, measured by :func:`busy_cores` when None), shared out, at least one.

    More threads than free cores only make them wait for one another: on a machine loaded by other
    jobs the default (one per core) ran the digits recipe 6x slower than one thread (issue 27).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = max(1, round(cores - (busy_cores() if busy is None else busy)))
    return max(1, free // max(1, processes))


def choose_threads(processes: int) -> dict[str, Any] | None:
    """Set ``OMP_NUM_THREADS`` (inherited by the ranks Lightning starts, which Lightning respects) and
    torch's thread count, unless the user set ``OMP_NUM_THREADS``; return what was chosen."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    busy = busy_cores()
    threads = threads_per_process(processes, busy)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return {"threads": threads, "processes": processes, "busy_cores": busy}
