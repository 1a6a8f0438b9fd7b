"""The shards' optimizer state in checkpoints, the strategy side: gathered on rank 0 over RPC in the worker
optimizer's format, kept at the fit's end (the shards leave with RPC at teardown), and each shard's part
restored on resume. Kept out of ``parameter_server.py`` so that the strategy's class stays one idea per hook."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.comm.ps import ParameterServerClient, local_shard
from lightning_strategies.comm.ps.spec import OptimizerSpec
from lightning_strategies.strategies._base import StrategyBase, unwrap_optimizer
from lightning_strategies.strategies._ps_overlap import PushOverlapMixin

__all__ = ["ShardStateMixin", "full_optimizer_state"]


def full_optimizer_state(strategy: str, checkpoint: Any) -> dict[str, Any]:
    """The checkpoint's one optimizer state dict in a whole optimizer's format (what shards load their parts of).

    Raises:
        ValueError: the checkpoint holds another number of optimizer states, or one without ``param_groups``.
    """
    states = checkpoint["optimizer_states"]
    if len(states) != 1 or "param_groups" not in states[0]:
        raise ValueError(
            f"{strategy} found {len(states)} optimizer states in the checkpoint (keys {[sorted(s) for s in states]}): "
            "expected one full optimizer state dict. Fix: resume from a checkpoint written by a one-optimizer run "
            "(ddp, ps, ps_ring or a single device)."
        )
    return dict(states[0])


class ShardStateMixin(PushOverlapMixin, StrategyBase):
    """Checkpoints of a strategy whose optimizer runs on parameter-server shards: set ``_client`` and ``_spec``
    while fitting."""

    _client: ParameterServerClient | None = None
    _spec: OptimizerSpec | None = None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The servers' optimizer state, gathered on rank 0 over RPC in the worker optimizer's format (it
        loads into a single-device optimizer too). Each group's ``lr`` is the worker's: the one its LR
        scheduler set for the next step, which a resumed run must start with (a shard holds the last push's)."""
        if self._client is None or self._spec is None:
            kept = self._state_after_fit(optimizer)  # after fit: the servers are gone
            return kept if kept is not None else super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        self.wait_for_pulls()
        if not self.is_global_zero:
            return {}
        state = self._client.gather_state_dict(self._spec, optimizer.param_groups)
        for group, worker_group in zip(state["param_groups"], optimizer.param_groups, strict=True):
            group["lr"] = worker_group["lr"]
        return state

    @override
    def on_train_end(self) -> None:
        # The shards and their state go with RPC at teardown, and the worker optimizer never steps: without
        # this, a Trainer.save_checkpoint after fit would silently save no momentum / Adam moments.
        if self._client is not None and self.optimizers:
            self.wait_for_pulls()
            self._keep_state_at_fit_end()
            self.barrier("ps_state_at_fit_end")  # no shard leaves (teardown) before rank 0 has read it
        super().on_train_end()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Restore each shard's part of the state, and the worker's group options (the lr schedulers use).
        No collective: a shard steps only once its own host's worker has pushed, after this returns."""
        if self._client is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        full = full_optimizer_state(type(self).__name__, checkpoint)
        optimizer = self.optimizers[0]
        optimizer.load_state_dict({"state": {}, "param_groups": full["param_groups"]})
        shard = local_shard(self.global_rank)
        if shard is not None:
            shard.load_state_dict(full)
