"""Every strategy predicted for a measured module on a cluster: step time, memory, bytes, a reason, a rank.

Every strategy steps the same samples: a data-parallel worker its ``batch``, a pipeline replica of
K stages K x ``batch`` in M micro-batches, a tensor-parallel group of T processes T x ``batch``.
Strategies that fit in a device's memory are ranked by step time; the others are listed, unranked.
``local_sgd`` and ``diloco`` are listed with their step time but never ranked: H local steps between
syncs change the optimisation, so their steps do not buy the same progress as a synchronous step
(compare their time to an accuracy, as ``benchmarks/cluster_diloco.py`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_strategies.advisor.cluster import Cluster
from lightning_strategies.advisor.ft_model import FT_STRATEGIES, predict_ft
from lightning_strategies.advisor.measure import Measurement
from lightning_strategies.advisor.memory import Memory, memory, pipeline_stages
from lightning_strategies.advisor.model import Prediction, Workload, predict
from lightning_strategies.comm.ps.spec import ELEMENTWISE_OPTIMIZERS

__all__ = [
    "STRATEGIES",
    "UNRANKED",
    "Advice",
    "NoStrategyFitsError",
    "StrategyAdvice",
    "advise",
    "model_key",
    "strategy_workload",
]

STRATEGIES = (
    "ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps1", "ps_ring", "async", "pipeline", "tensor", *FT_STRATEGIES,
)  # fmt: skip
#: the optimizers ps_ring's shards can step (a chunk of the ring cuts tensors anywhere), by class name
_ELEMENTWISE = frozenset(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
#: listed with their step time, never ranked: their steps are not a synchronous step's progress
UNRANKED = ("local_sgd", "diloco")
SYNC_EVERY = 100  # FTStrategy's default H
_MODEL = {"ps1": "ps_1"}
PIPELINE_SCHEDULE = "1f1b"  # PipelineStrategy's default
_GIB = 1 << 30


class NoStrategyFitsError(ValueError):
    """No strategy holds the model in a device's memory."""


@dataclass(frozen=True)
class StrategyAdvice:
    """One strategy's prediction.

    Attributes:
        name: the strategy (``conf/strategy/<name>.yaml``; ``ps1`` is ``ps`` with one server).
        options: the strategy's arguments the prediction assumes (stages, micro-batches, tp_size).
        step_s: seconds per step; ``math.inf`` where the strategy cannot run the model.
        efficiency: one device's step alone over this step (1: linear scaling).
        memory: the busiest device's peak.
        link_bytes: bytes on the busiest link per step (one direction).
        nic_bytes: bytes through the busiest node's network link per step.
        fits: whether ``memory`` fits in a device (and the strategy can run the model at all).
        reason: one line on what sets its pace, or why it does not fit.
        rank: 1 for the fastest strategy that fits; ``None`` for one that does not.
    """

    name: str
    options: dict[str, Any]
    step_s: float
    efficiency: float
    memory: Memory
    link_bytes: float
    nic_bytes: float
    fits: bool
    reason: str
    rank: int | None = None

    def overrides(self) -> list[str]:
        """The Hydra app's overrides that select this strategy (``strategy=ps strategy.num_servers=1``)."""
        base = "ps" if self.name == "ps1" else self.name
        return [f"strategy={base}", *(f"strategy.{k}={v}" for k, v in self.options.items())]


@dataclass(frozen=True)
class Advice:
    """The strategies for one module on one cluster, ranked."""

    cluster: Cluster
    measurement: Measurement
    batch: int
    rows: tuple[StrategyAdvice, ...] = field(default_factory=tuple)

    def best(self) -> StrategyAdvice:
        """The first choice.

        Raises:
            NoStrategyFitsError: naming the smallest footprint against the device's memory.
        """
        ranked = [r for r in self.rows if r.rank is not None]
        if ranked:
            return min(ranked, key=lambda r: r.rank or 0)
        runnable = [r for r in self.rows if math.isfinite(r.step_s)] or list(self.rows)
        least = min(runnable, key=lambda r: r.memory.total)
        raise NoStrategyFitsError(
            f"no strategy fits this model on {self.cluster.name}: the smallest footprint is {least.name}'s "
            f"{least.memory.total / _GIB:.2f} GiB per device, expected at most {self.cluster.device_memory_gib:g} GiB. "
            "Fix: a smaller per-device batch, more pipeline stages or tensor-parallel processes (more devices), "
            "or devices with more memory"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def model_key(name: str) -> str:
    """The scale model's name (:func:`~lightning_strategies.advisor.model.predict`) of an advisor strategy
    (``ps1`` is the model's ``ps_1``; the others are the same)."""
    return _MODEL.get(name, name)


def strategy_workload(
    m: Measurement,
    name: str,
    batch: int,
    *,
    num_stages: int = 1,
    microbatches: int = 1,
    tp_size: int = 1,
    world: int = 1,
) -> Workload:
    """What one step of strategy ``name`` computes and moves for ``m`` at ``batch`` per data-parallel worker.

    Args:
        m: the module measured.
        name: one of :data:`STRATEGIES`.
        batch: the per-device (data-parallel) batch.
        num_stages: the pipeline's stages K (``pipeline`` only): a replica steps K x ``batch``.
        microbatches: the pipeline's micro-batches M per step (``pipeline`` only).
        tp_size: the tensor-parallel group T (``tensor`` only): a group steps T x ``batch``.
        world: the processes (``ps_ring`` only: each one's shard steps ``1/world`` of the optimizer).
    """
    if name == "pipeline":
        return _pipeline_work(m, batch, num_stages, microbatches)
    if name == "tensor":
        return _tensor_work(m, batch, tp_size)
    if name == "ps_ring":  # each rank's shard steps its chunk of every bucket
        return _work(m, batch, optimizer_s=m.optimizer_s / max(1, world))
    # ps and async: the shards step (the model's ps host work), not the workers
    return _work(m, batch, optimizer_s=0.0 if model_key(name) in ("ps", "ps_flat", "ps_1", "async") else None)


def _work(m: Measurement, batch: int, *, optimizer_s: float | None = None, **kw: Any) -> Workload:
    """``optimizer_s``: the process's optimizer step; ``None``: the whole model's (``m.optimizer_s``)."""
    step = m.optimizer_s if optimizer_s is None else optimizer_s
    return Workload(grad_bytes=float(m.grad_bytes), tensors=len(m.tensors), optimizer_s=step, **kw)


def _pipeline_work(m: Measurement, batch: int, k: int, micro: int) -> Workload:
    mb = k * batch / micro
    stages = pipeline_stages(m, k)
    times = [m.block_seconds(i, mb) for i in range(len(m.blocks))]  # a micro-batch's, not the batch's share
    fwd = [sum(times[i][0] for i in s) for s in stages]
    bwd = [sum(times[i][1] for i in s) for s in stages]
    total = sum(fwd) + sum(bwd)
    boundary = max((m.blocks[s[-1]].output_bytes for s in stages[:-1]), default=0) * mb / m.batch_size
    # each stage steps its own blocks' parameters: the largest stage's share of the optimizer step
    params = [sum(m.blocks[i].param_bytes for i in s) for s in stages]
    owned = max(params) / sum(params) if sum(params) else 1.0
    # PipelineStrategy's default schedule (1F1B), each stage its own blocks' time
    return _work(m, batch, stages=k, microbatches=micro, activation_bytes=boundary, schedule=PIPELINE_SCHEDULE,
                 stage_compute_s=max(f + b for f, b in zip(fwd, bwd, strict=True)),
                 stage_seconds=tuple(f + b for f, b in zip(fwd, bwd, strict=True)),
                 backward_share=sum(bwd) / total if total else 2 / 3,
                 optimizer_s=owned * m.optimizer_s)  # fmt: skip


def _tensor_work(m: Measurement, batch: int, t: int) -> Workload:
    scale = t * batch / m.batch_size
    # a rank steps its shards of the split layers and the whole tensors (DTensor's dispatch of the step:
    # Costs.tensor_layer_s)
    whole = min(float(m.tensor_replicated_bytes), float(m.param_bytes))
    owned = (whole + (m.param_bytes - whole) / t) / m.param_bytes if m.param_bytes else 1.0
    return _work(m, batch, optimizer_s=owned * m.optimizer_s, tensor_size=t,
                 tensor_collectives=tuple(x * scale for x in m.tensor_payloads),
                 tensor_split_share=m.tensor_split_share, tensor_layers=m.tensor_split_layers,
                 tensor_replicated_bytes=float(m.tensor_replicated_bytes))  # fmt: skip


def _reason(name: str, pred: Prediction, mem: Memory, cluster: Cluster, options: dict[str, Any]) -> str:
    own = pred.phases.get("compute", 0.0) + pred.phases.get("loop", 0.0)  # the worker's compute and training loop
    comm = 1 - own / pred.step_s if pred.step_s > 0 else 0.0
    pace = f"communication {comm:.0%} of the step, {pred.link_bytes / 1e6:.3g} MB on the busiest link"
    what = {
        "ddp": "the backend's ring all-reduce of every gradient",
        "ring": "our ring all-reduce of every gradient",
        "ring_hier": "one ring per local rank across nodes, 1/L of the gradient each",
        "ring_bf16": "the ring with bf16 on the wire: half the bytes",
        "ps": f"sharded parameter servers: {pred.messages:g} RPC messages per step per worker",
        "ps1": "one server receives and sends every gradient",
        "ps_ring": "sharded servers on the ring's reduce-scatter and all-gather: the ring's bytes, the optimizer on "
        "1/P",
        "async": "sharded servers without a barrier (stale updates)",
        "ft": "torchft: DDP's all-reduce after the backward, a quorum and a commit every step",
    }.get(name, "")
    if name in UNRANKED:
        what = (f"not ranked: an all-reduce of the weights every H={options['sync_every']} local steps "
                f"(a different optimisation: compare time to accuracy, not steps)")  # fmt: skip
    if name == "pipeline":
        k, micro = options["num_stages"], options["microbatches"]
        what = f"K={k} stages x M={micro} micro-batches, bubble {(k - 1) / (micro + k - 1):.0%}"
    if name == "tensor":
        what = f"T={options['tp_size']}: layers split, activations all-reduced"
    return f"{what}; {pace}"


def _row(name: str, m: Measurement, cluster: Cluster, batch: int, compute_s: float, **options: Any) -> StrategyAdvice:
    world = cluster.world
    k, micro, t = options.get("num_stages", 1), options.get("microbatches", 1), options.get("tp_size", 1)
    work = strategy_workload(m, name, batch, num_stages=k, microbatches=micro, tp_size=t, world=world)
    if name in FT_STRATEGIES:
        pred = predict_ft(name, cluster.costs(compute_s), world, work, sync_every=options.get("sync_every", 1))
    else:
        pred = predict(model_key(name), cluster.costs(compute_s), world, work)
    mem = memory(name, m, batch=batch, world=world, stages=k, microbatches=micro, tp_size=t)
    fits = mem.total <= cluster.memory_bytes
    reason = _reason(name, pred, mem, cluster, options)
    if not fits:
        reason = f"needs {mem.total / _GIB:.2f} GiB per device, over the {cluster.device_memory_gib:g} GiB; " + reason
    eff = compute_s / pred.step_s if pred.step_s > 0 else 1.0
    return StrategyAdvice(name, options, pred.step_s, eff, mem, pred.link_bytes, pred.nic_bytes, fits, reason)


def _unavailable(name: str, why: str) -> StrategyAdvice:
    return StrategyAdvice(name, {}, math.inf, 0.0, Memory(0, 0, 0, 0, 0), 0.0, 0.0, False, why)


def _pipelines(m: Measurement, cluster: Cluster, batch: int, compute_s: float) -> StrategyAdvice:
    if not m.pipeline or len(m.blocks) < 2:
        return _unavailable("pipeline", "the module has no pipeline_layers() of 2 or more blocks to cut")
    rows = []
    for k in (d for d in _divisors(cluster.world) if d <= len(m.blocks)):
        for micro in (k, 2 * k, 4 * k, 8 * k):
            if micro <= k * batch and (k * batch) % micro == 0:
                rows.append(_row("pipeline", m, cluster, batch, compute_s, num_stages=k, microbatches=micro))
    if not rows:
        return _unavailable("pipeline", f"no stage count divides {cluster.world} processes with a block per stage")
    return min(rows, key=lambda r: (not r.fits, r.step_s))


def _tensors(m: Measurement, cluster: Cluster, batch: int, compute_s: float) -> StrategyAdvice:
    sizes = [t for t in _divisors(cluster.world) if m.tensor_split_gcd and m.tensor_split_gcd % t == 0]
    if not sizes:
        return _unavailable("tensor", "no nn.Linear layers whose widths divide by a tensor-parallel group size")
    rows = [_row("tensor", m, cluster, batch, compute_s, tp_size=t) for t in sizes]
    return min(rows, key=lambda r: (not r.fits, r.step_s))


def advise(
    m: Measurement,
    cluster: Cluster,
    *,
    batch: int | None = None,
    strategies: Sequence[str] = STRATEGIES,
    sync_every: int = SYNC_EVERY,
) -> Advice:
    """Predict, explain and rank ``strategies`` for ``m`` on ``cluster``.

    Args:
        m: the module measured (:func:`~lightning_strategies.advisor.measure.measure`).
        cluster: where it is to train.
        batch: the per-device (data-parallel) batch; default the measured batch.
        strategies: which to consider.
        sync_every: H of ``local_sgd`` and ``diloco`` (listed, not ranked: :data:`UNRANKED`).

    Raises:
        ValueError: an unknown strategy name.
    """
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        raise ValueError(f"advise: found strategies {unknown}: expected some of {list(STRATEGIES)}. Fix: drop them")
    batch = batch or m.batch_size
    compute_s = m.step_s * batch / m.batch_size
    rows: list[StrategyAdvice] = []
    for name in strategies:
        if cluster.world < 2 and name not in ("ddp",):
            rows.append(_unavailable(name, "one process: nothing to distribute"))
        elif name == "ring_hier" and cluster.nodes < 2:
            row = _row(name, m, cluster, batch, compute_s)
            rows.append(StrategyAdvice(**{**row.__dict__, "reason": "one node: the flat ring; " + row.reason}))
        elif name == "ps_ring" and m.optimizer not in _ELEMENTWISE:
            why = f"{m.optimizer} is not an elementwise optimizer: a chunk of the ring cuts tensors anywhere (use ps)"
            rows.append(_unavailable(name, why))
        elif name == "pipeline":
            rows.append(_pipelines(m, cluster, batch, compute_s))
        elif name == "tensor":
            rows.append(_tensors(m, cluster, batch, compute_s))
        elif name == "ps1":
            rows.append(_row(name, m, cluster, batch, compute_s, num_servers=1))
        elif name in UNRANKED:
            rows.append(_row(name, m, cluster, batch, compute_s, sync_every=sync_every))
        else:
            rows.append(_row(name, m, cluster, batch, compute_s))
    order = sorted((r for r in rows if r.fits and r.name not in UNRANKED), key=lambda r: r.step_s)
    ranks = {id(r): i + 1 for i, r in enumerate(order)}
    ranked = tuple(StrategyAdvice(**{**r.__dict__, "rank": ranks.get(id(r))}) for r in rows)
    ranked = tuple(sorted(ranked, key=lambda r: (r.rank is None, r.rank or 0, r.memory.total)))
    return Advice(cluster, m, batch, ranked)
