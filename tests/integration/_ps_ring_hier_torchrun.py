"""What each torchrun worker of ``test_ps_ring_hierarchical_torchrun.py`` runs (2 "nodes" x 2 processes).

Three tiny fits in a row on the same processes, each a fresh ``Trainer``: ``RingParameterServerStrategy()``
(``hierarchical=None``, so hierarchical on 2 nodes; buckets of 64 bytes, so that the tiny model makes 3), the
same with ``hierarchical=False`` (one flat ring of 4), and the hierarchical one with ``gradient_clip_val=0.05``
(by norm: the shards agree on the norm over both groups). Rank 0 saves each fit's weights and the optimizer
state gathered from the shards to ``<out-dir>/<fit>.pt``; every rank writes ``<out-dir>/rank<r>.json``: per fit,
whether the push was hierarchical, the node layout, its owned chunks and the ``comm/`` metrics it logged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from _ps_hier_torchrun import run_fits
from _torchrun_fit import make_loader
from lightning.pytorch.callbacks import Callback
from lightning_utils import TinyRegressor, quiet_trainer

from lightning_strategies import RingParameterServerStrategy

MAX_STEPS = 6
# 64-byte buckets over TinyRegressor's 4 tensors (512, 64, 256, 16 bytes): 3 buckets, in reverse layer order
BUCKET_CAP_MB = 64 / 2**20
#: fit name -> (hierarchical, gradient_clip_val)
FITS: dict[str, tuple[bool | None, float | None]] = {
    "hier": (None, None),
    "flat": (False, None),
    "hier_clip": (None, 0.05),
}


class RingRecord(Callback):
    """The push's layout, this rank's owned chunks and the ``comm/`` values it logged last."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, RingParameterServerStrategy) and strategy.shards is not None
        self.record["hierarchical"] = strategy.is_hierarchical
        self.record["owned"] = [list(b.owned) for b in strategy.shards.buckets]
        self.record["bucket_numel"] = [b.grad.numel() for b in strategy.shards.buckets]
        self.record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}


def one_fit(hierarchical: bool | None, clip: float | None) -> tuple[dict[str, Any], dict[str, Any]]:
    model = TinyRegressor()
    keep = RingRecord()
    strategy = RingParameterServerStrategy(
        hierarchical=hierarchical, bucket_cap_mb=BUCKET_CAP_MB, timeout=timedelta(seconds=60)
    )
    trainer = quiet_trainer(strategy, 2, num_nodes=2, max_steps=MAX_STEPS, use_distributed_sampler=False,
                            gradient_clip_val=clip, log_every_n_steps=1, callbacks=[keep])  # fmt: skip
    trainer.fit(model, make_loader("ring", 4))
    state = trainer.strategy.optimizer_state(trainer.optimizers[0])  # kept at the end of fit
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "optimizer": state}, keep.record


if __name__ == "__main__":
    run_fits(FITS, one_fit, every_rank=False, description=(__doc__ or "").splitlines()[0])
