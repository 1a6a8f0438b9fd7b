"""Step time and bytes of the torchft strategies ``ft``, ``local_sgd`` and ``diloco`` (``FTStrategy``).

Pure arithmetic, as :mod:`lightning_strategies.advisor.model`, whose ring all-reduce it reuses.
Every process is a replica group of one (P replicas); notation as there (D gradient bytes,
``costs.compute_s`` a worker's forward and backward).

    ft         after the backward (no overlap: the step averages the gradients in one flat copy),
               the step's quorum and commit (``Costs.ft_protocol_s``: the Lighthouse's quorum round
               trip, the Manager's ``should_commit``), then torchft's all-reduce of the flat D on the
               backend (gloo's ring in 1 MiB segments on CPU, NCCL's on GPUs): 2(P-1) steps of D/P, every
               replica sends 2(P-1)/P x D per step, a flat ring across nodes
    local_sgd  H = ``sync_every`` local steps, then the same protocol and all-reduce of the parameters
               (D): per step, compute + (protocol + all-reduce) / H, and 1/H of ft's bytes
    diloco     local_sgd's schedule and bytes (the pseudo-gradients); its outer SGD step, a few passes
               over D once every H steps, is host work this model leaves out (not measured apart:
               ``benchmarks/advisor_ft.py`` times whole steps)

Streaming DiLoCo (``fragment_sync_delay`` > 0) overlaps a fragment's all-reduce with the next inner
steps; this model prices the blocking syncs (``fragment_sync_delay=0``, the default): an upper
bound for the overlapped ones. Neither models convergence: local_sgd and diloco take more steps
(or fewer) than ddp to an accuracy, so their step time is not a time to accuracy.
"""

from __future__ import annotations

import math

from lightning_strategies.advisor.costs import Costs, Prediction, Workload, contention, with_loop
from lightning_strategies.advisor.model import _ring, _segments

__all__ = ["FT_STRATEGIES", "predict_ft"]

#: the strategies this module prices (``FTStrategy``'s algorithms)
FT_STRATEGIES = ("ft", "local_sgd", "diloco")


def predict_ft(strategy: str, costs: Costs, world: int, work: Workload, *, sync_every: int = 100) -> Prediction:
    """The mean step of ``strategy`` (one of :data:`FT_STRATEGIES`) at ``world`` replicas.

    Args:
        strategy: ``"ft"``, ``"local_sgd"`` or ``"diloco"``.
        costs: the machine's or cluster's constants (``ft_protocol_s`` the quorum and commit of a sync).
        world: replicas P (one process each).
        work: the step's gradient (= parameter) bytes D.
        sync_every: H, local steps per sync (``local_sgd`` / ``diloco``; ``ft`` syncs every step).

    Raises:
        ValueError: an unknown strategy, ``world < 1`` or ``sync_every < 1``.
    """
    if strategy not in FT_STRATEGIES:
        raise ValueError(f"predict_ft: found strategy {strategy!r}: expected one of {list(FT_STRATEGIES)}")
    if world < 1 or sync_every < 1:
        raise ValueError(f"predict_ft: found world={world}, sync_every={sync_every}: expected both >= 1")
    every = 1 if strategy == "ft" else sync_every
    d = work.grad_bytes
    latency, bandwidth, reduce = _ring(costs, world, [d], segment=costs.gloo_segment_bytes, overhead=0.0)
    k, bw = contention(world, costs.cores), costs.wire(world)
    protocol = costs.ft_protocol_s if world > 1 else 0.0
    phases = {
        "compute": k * costs.compute_s,
        "protocol": k * protocol / every,
        "latency": k * latency / every,
        "bandwidth": bw * bandwidth / every,
        "reduce": k * reduce / every,
    }
    sent = 2 * (world - 1) / world * d / every
    messages = 2 * (world - 1) * _segments(d / world, costs.gloo_segment_bytes) / every if world > 1 else 0.0
    nodes = math.ceil(world / costs.local_size)
    across = sent if nodes > 1 else 0.0  # a flat ring: the rank before each node boundary sends it all across
    pred = Prediction(sum(phases.values()), phases, sent, sent, across, messages, inter_sent_bytes=across)
    return with_loop(pred, costs, world, work)
