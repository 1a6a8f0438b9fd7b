"""What each torchrun worker of ``test_ring_hierarchical_torchrun.py`` runs (2 "nodes" x 2 processes).

1. The tiny fit of ``_torchrun_fit`` with ``RingAllReduceStrategy()`` (``hierarchical=None``): on
   2 nodes it must choose the hierarchical ring, with the node layout Lightning's
   ``TorchElasticEnvironment`` reports. Rank 0 saves the weights to ``<out-dir>/weights.pt``.
2. Then, on the process group the fit left, ``hierarchical_all_reduce`` on the strategy's layout
   against ``dist.all_reduce``, with its node-split byte counts.

Every rank writes ``<out-dir>/rank<r>.json``: the strategy's choice and layout, the comm metrics it
logged, and the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _torchrun_fit import fit
from lightning.pytorch.callbacks import Callback

from lightning_strategies.comm.ring import hierarchical_all_reduce, new_hierarchical_groups
from lightning_strategies.strategies.ring import RingAllReduceStrategy

MAX_STEPS = 6
SIZES = (1, 5, 1001, 2**16 + 1)


def compare(strategy: RingAllReduceStrategy) -> list[dict[str, Any]]:
    """hierarchical_all_reduce vs dist.all_reduce on the strategy's node layout."""
    layout = strategy.node_layout
    assert layout is not None
    intra, inter = new_hierarchical_groups(layout, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for numel in SIZES:
        for op in ("sum", "avg"):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(31 * rank + numel), dtype=torch.float64)
            ref = x.clone()
            dist.all_reduce(ref)
            if op == "avg":
                ref /= world
            stats = hierarchical_all_reduce(x, intra, inter, op=op)
            hi, lo = x.clone(), x.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            rows.append({
                "numel": numel,
                "op": op,
                "max_err": float((x - ref).abs().max()),
                "scale": float(ref.abs().max()) + 1.0,
                "identical_on_ranks": bool(torch.equal(hi, lo)),
                "inter_node_bytes_sent": stats.inter_node_bytes_sent,
                "inter_node_bytes_received": stats.inter_node_bytes_received,
                "bytes_sent": stats.bytes_sent,
            })  # fmt: skip
    return rows


class _KeepCommMetrics(Callback):
    """The ``comm/`` values this rank logged last (its ``callback_metrics`` at the end of training)."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = RingAllReduceStrategy()
    keep = _KeepCommMetrics()
    weights = fit("ring", strategy, devices=2, num_nodes=2, max_steps=MAX_STEPS, callbacks=[keep])
    layout = strategy.node_layout
    record = {
        "rank": dist.get_rank(),
        "env": type(strategy.cluster_environment).__name__,
        "hierarchical": strategy.is_hierarchical,
        "nodes": [list(n) for n in layout.nodes] if layout is not None else None,
        "metrics": keep.metrics,
        "compare": compare(strategy),
    }
    rank = int(os.environ["RANK"])
    if rank == 0:
        torch.save(weights, args.out_dir / "weights.pt")
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
