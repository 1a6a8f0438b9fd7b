"""A parameter server shard's state: its values, and its part of the optimizer state (to checkpoint, resume
and restore)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_strategies.comm.ps.plan import Slice
from lightning_strategies.comm.ps.spec import hyperparameters
from lightning_strategies.comm.streams import StreamOrder

__all__ = ["ShardState"]


class ShardState:
    """The state methods of :class:`~lightning_strategies.comm.ps.ParameterShard`, which sets these attributes."""

    _lock: threading.Lock
    _order: StreamOrder
    params: list[Tensor]
    slices: list[Slice]
    optimizer: Optimizer | None
    version: int
    _groups: list[int]
    _group_ids: list[int]

    def values(self) -> list[Tensor]:
        """Copies of the shard's current tensors, ordered for the caller's stream."""
        with self._lock:
            with self._order.running():
                copies = [p.detach().clone() for p in self.params]
            self._order.give(copies)
        return copies

    def state_dict(self) -> dict[str, Any]:
        """This shard's optimizer state: ``{"state": {slice: its state}, "param_groups": {group: options},
        "version": steps}`` (:meth:`ParameterServerClient.gather_state_dict` joins the shards')."""
        with self._lock:
            if self.optimizer is None:
                return {"state": {}, "param_groups": {}, "version": self.version}
            with self._order.running():
                sd = self.optimizer.state_dict()
                # copies, like the replies: the caller reads (or an RPC sends) them after the lock
                state = {self.slices[i]: _copy_state(st) for i, st in sd["state"].items()}
            self._order.give(v for st in state.values() for v in st.values() if isinstance(v, Tensor))
            return {
                "state": state,
                "param_groups": {
                    g: hyperparameters(group) for g, group in zip(self._group_ids, sd["param_groups"], strict=True)
                },
                "version": self.version,
            }

    def load_state_dict(self, full_state: Mapping[str, Any], version: int | None = None) -> None:
        """Load this shard's part of a full optimizer state dict (worker optimizer format).

        Args:
            full_state: as :meth:`ParameterServerClient.gather_state_dict` returns (or a plain
                optimizer's ``state_dict()`` of the same model).
            version: the step count to resume at (the barrier needs the workers' step).
        """
        with self._lock:
            if version is not None:
                self.version = version
            if self.optimizer is None:
                return
            groups = []
            for g in self._group_ids:
                options = hyperparameters(full_state["param_groups"][g])
                groups.append({**options, "params": [k for k, gk in enumerate(self._groups) if gk == g]})
            by_tensor = {int(f): s for f, s in full_state["state"].items()}
            self._order.take(v for st in by_tensor.values() for v in st.values() if isinstance(v, Tensor))
            with self._order.running():
                state = {
                    k: _slice_state(by_tensor[sl.tensor], sl, p)
                    for k, (sl, p) in enumerate(zip(self.slices, self.params, strict=True))
                    if sl.tensor in by_tensor
                }
                self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def load_values(self, values: Sequence[Tensor]) -> None:
        """Overwrite the shard's tensors (e.g. with the weights of a restored checkpoint)."""
        with self._lock, torch.no_grad():
            self._order.take(values)
            with self._order.running():
                for p, v in zip(self.params, values, strict=True):
                    p.copy_(v.reshape(p.shape))


def _copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: v.clone() if isinstance(v, Tensor) else v for key, v in state.items()}


def _slice_state(state: Mapping[str, Any], sl: Slice, param: Tensor) -> dict[str, Any]:
    """A slice's part of its tensor's optimizer state (per-element state: a tensor larger than the slice).

    Copied: ``Optimizer.load_state_dict`` keeps a ``step`` tensor as given, and slices of one tensor
    sharing it would each increment it.
    """
    return {
        key: (
            v.reshape(-1)[sl.start : sl.stop].clone().view(param.shape)
            if v.dim() >= 1 and v.numel() > param.numel()
            else v.clone()
        )
        if isinstance(v, Tensor)
        else v
        for key, v in state.items()
    }
