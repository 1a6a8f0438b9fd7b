"""The advisor's measurement of the emulated runs' MLP (``benchmarks/emulated/_fit.py`` at batch 32), and its JSON.

``advisor_cluster.py`` stores one next to every fit (taken with its compute probe, right before it), and
``advisor_validation.py`` predicts a session from its own fits' measurements, at the CPU they had.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from benchmarks.emulated._fit import IN, MLP, OUT
from lightning_strategies.advisor import measure
from lightning_strategies.advisor.measure import Block, Measurement, TensorBytes

__all__ = ["REPEATS", "from_json", "mlp_measurement", "to_json"]

REPEATS = 15  # each block's timings (medians; the quarter batch in turn with the batch)


def mlp_measurement(repeats: int = REPEATS) -> Measurement:
    """``advisor.measure`` of the runs' MLP (``MLP(1024, 2)``) on a batch of 32, on one torch thread as each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = (torch.randn(32, IN), torch.randn(32, OUT))
        return measure(MLP(1024, 2), batch, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def to_json(m: Measurement) -> dict[str, Any]:
    """``m`` as plain JSON values (:func:`from_json` restores it)."""
    return dataclasses.asdict(m)


def from_json(raw: dict[str, Any]) -> Measurement:
    """The :class:`Measurement` that :func:`to_json` wrote."""
    fields = {f.name for f in dataclasses.fields(Measurement)}
    if set(raw) - fields or {"blocks", "tensors", "batch_size"} - set(raw):
        raise ValueError(f"a stored measurement with keys {sorted(raw)}: expected Measurement's ({sorted(fields)})")
    rest = {k: v for k, v in raw.items() if k not in ("blocks", "tensors", "tensor_payloads")}
    return Measurement(**rest, blocks=tuple(Block(**b) for b in raw["blocks"]),
                       tensors=tuple(TensorBytes(**t) for t in raw["tensors"]),
                       tensor_payloads=tuple(raw.get("tensor_payloads", ())))  # fmt: skip
