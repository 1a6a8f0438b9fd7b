"""Peak memory per device of each strategy, from a :class:`~lightning_strategies.advisor.measure.Measurement`.

P, G, O: the model's parameter (and buffer), gradient and optimizer-state bytes; A(b): what autograd
saves at a per-device batch of b (linear in b); S shards, K stages, T tensor-parallel processes.

    ddp, ring, ring_hier   P + G + O + A(b), plus DDP's buckets (a copy of G)
    ring_bf16              the same, plus one bucket's bf16 copy on the wire
    ps, async              P + G + A(b) on the worker; its shard P/S + O/S; a packed push (G) and,
                           during the shard's apply, its averaged gradient (G/S)
    ps1                    rank 0 serves all of it: P + G + A(b) + P + O, and the push
    pipeline               stage s: its blocks' P + G + O and, under 1F1B, min(K - s, M) micro-batches'
                           activations of its blocks (GPipe: M); send and receive buffers of a boundary
    tensor                 the split layers' P, G and O over T; activations at the group's batch T x b,
                           the split part over T; one collective's buffer
    ft                     P + G + O + A(b), and the flat copy of G it all-reduces
    local_sgd, diloco      P + G + O + A(b), the global copy of the weights W (the outer loop's backup)
                           and a fragment's flat copy (W / F); diloco also the outer gradient (W) and,
                           with outer momentum, its buffer (W)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_strategies.advisor.measure import Measurement
from lightning_strategies.comm.pipeline import partition_blocks

__all__ = ["BUCKET_BYTES", "Memory", "memory", "pipeline_memory", "pipeline_stages"]

BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds at its peak, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def model_state(self) -> float:
        """Everything but the communication buffers (what tensor accounting of a rank sees)."""
        return self.total - self.buffers


def _acts(m: Measurement, batch: float, saved: float | None = None) -> float:
    return (m.saved_bytes if saved is None else saved) * batch / m.batch_size


def pipeline_stages(m: Measurement, stages: int) -> list[list[int]]:
    """The blocks of each stage, split by parameter counts (``PipelineStrategy(balance="params")``)."""
    counts = partition_blocks([max(b.param_bytes, 1) for b in m.blocks], stages)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def memory(
    strategy: str,
    m: Measurement,
    *,
    batch: int,
    world: int,
    stages: int = 1,
    microbatches: int = 1,
    tp_size: int = 1,
    schedule: str = "1f1b",
    outer_momentum: float = 0.9,
    fragments: int = 1,
) -> Memory:
    """The busiest device's peak of ``strategy`` at a per-device (data-parallel) ``batch``
    (``outer_momentum`` and ``fragments``: DiLoCo's outer SGD and streaming fragments)."""
    p, g, o = float(m.param_bytes + m.buffer_bytes), float(m.grad_bytes), float(m.optimizer_bytes)
    if strategy == "ft":
        return Memory(p, g, o, _acts(m, batch), g)
    if strategy in ("local_sgd", "diloco"):
        w = float(m.param_bytes)
        outer = (w if strategy == "diloco" else 0.0, w if strategy == "diloco" and outer_momentum > 0 else 0.0)
        return Memory(p + w, g + outer[0], o + outer[1], _acts(m, batch), w / max(1, fragments))
    if strategy in ("ddp", "ring", "ring_hier", "ring_bf16"):
        wire = min(g, BUCKET_BYTES) / 2 if strategy == "ring_bf16" else 0.0
        return Memory(p, g, o, _acts(m, batch), g + wire)
    if strategy in ("ps", "ps_flat", "async"):
        return Memory(p + p / world, g, o / world, _acts(m, batch), g + g / world)
    if strategy == "ps_ring":  # each bucket's gradients and values in flat buffers; the optimizer on 1/P
        return Memory(p, g, o / world, _acts(m, batch), 2 * g)
    if strategy == "ps1":
        return Memory(2 * p, g, o, _acts(m, batch), g)
    if strategy == "pipeline":
        return max(pipeline_memory(m, batch=batch, stages=stages, microbatches=microbatches, schedule=schedule),
                   key=lambda r: r.total)  # fmt: skip
    if strategy == "tensor":
        split, t = float(m.tensor_split_param_bytes), tp_size
        held = p - split + split / t
        share = held / p if p else 1.0
        saved = m.saved_bytes - sum(b.split_saved_bytes for b in m.blocks) * (1 - 1 / t)
        payload = max(m.tensor_payloads, default=0.0) * t * batch / m.batch_size
        return Memory(held, g * share, o * share, _acts(m, t * batch, saved), payload)
    raise ValueError(
        f"memory: unknown strategy {strategy!r}: expected one of ddp, ring, ring_hier, ring_bf16, ps, ps_flat, ps1, "
        "ps_ring, async, pipeline, tensor, ft, local_sgd, diloco. Fix: name one of them"
    )


def pipeline_memory(
    m: Measurement, *, batch: int, stages: int, microbatches: int, schedule: str = "1f1b"
) -> list[Memory]:
    """Each stage's peak, in stage order (:func:`memory` reports the largest)."""
    return [_stage(m, s, b, batch, stages, microbatches, schedule) for s, b in enumerate(pipeline_stages(m, stages))]


def _stage(m: Measurement, s: int, blocks: list[int], batch: int, k: int, micro: int, schedule: str) -> Memory:
    total_p = max(1, m.param_bytes)
    params = float(sum(m.blocks[i].param_bytes for i in blocks))
    share = params / total_p
    held = min(k - s, micro) if schedule.lower() == "1f1b" else micro
    mb = k * batch / micro  # a replica takes K x the batch, in M micro-batches
    saved = sum(m.blocks[i].saved_bytes for i in blocks)
    boundary = max(m.blocks[blocks[-1]].output_bytes, m.blocks[blocks[0] - 1].output_bytes if blocks[0] else 0)
    return Memory(
        params,
        m.grad_bytes * share,
        m.optimizer_bytes * share,
        held * _acts(m, mb, saved),
        2 * boundary * mb / m.batch_size,
    )
