"""Asynchronous parameter servers (no Lightning import), built on :mod:`lightning_strategies.comm.ps`:
shards that apply each push at once, and the worker's client."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from lightning_strategies.comm.async_.messages import RECORD_LIMIT
from lightning_strategies.comm.ps import (
    Packed,
    ParameterServerClient,
    ParameterShard,
    hosted_shard,
    pack,
    payload_bytes,
)
from lightning_strategies.comm.rpc import ShardError

__all__ = ["STALENESS_LR", "AsyncParameterServerClient", "AsyncParameterShard", "AsyncReply", "StalenessLR"]

StalenessLR = Literal["none", "inverse"]
STALENESS_LR: tuple[str, ...] = ("none", "inverse")


@dataclass
class AsyncReply:
    """A shard's answer to one asynchronous push or pull.

    Attributes:
        values: the shard's tensors after the push (a packed copy), or ``None`` when not pulled.
        version: updates the shard has applied so far.
        staleness: the pushed gradient's staleness, or -1 for a pull alone.
        step_bytes: payload bytes of this exchange (gradients in plus values out).
    """

    values: Packed | None
    version: int
    staleness: int
    step_bytes: int


class AsyncParameterShard(ParameterShard):
    """A shard that applies each push alone, as soon as it arrives, recording its *staleness*: the
    updates applied between the worker's last pull and this push.

    Args:
        *args: as :class:`~lightning_strategies.comm.ps.ParameterShard`.
        staleness_lr: ``"inverse"`` divides a gradient's learning rate by ``1 + staleness`` (Zhang et
            al. 2016, "Staleness-aware async-SGD"); ``"none"`` keeps it.
        **kwargs: as :class:`~lightning_strategies.comm.ps.ParameterShard` (``timeout`` is unused).

    Raises:
        ValueError: for a ``staleness_lr`` not in :data:`STALENESS_LR`.
    """

    def __init__(self, *args: Any, staleness_lr: StalenessLR = "none", **kwargs: Any) -> None:
        if staleness_lr not in STALENESS_LR:
            raise ValueError(
                f"staleness_lr={staleness_lr!r}: expected one of {list(STALENESS_LR)}; pass 'none' to use the "
                "worker's lr as is, or 'inverse' to divide it by 1 + staleness"
            )
        super().__init__(*args, **kwargs)
        self.staleness_lr = staleness_lr
        self.clocks = [0] * self.num_workers
        # the shard version each worker's weights came from (its last pull of this shard)
        self._version_pulled = [0] * self.num_workers
        self.staleness_sum = 0
        self.staleness_max = 0
        self.pushes = 0
        # (worker, worker's clock after the push, staleness), oldest first
        self.log: deque[tuple[int, int, int]] = deque(maxlen=RECORD_LIMIT)

    def push_pull(
        self, worker: int, grads: list[Tensor | None], lrs: list[float], *, pull: bool
    ) -> AsyncReply | ShardError:
        """Apply ``grads`` now, never waiting for another worker; answer with the new values when ``pull``."""
        # on a GPU the lock's order is the device's too: every push's step runs on the shard's one stream,
        # after the stream its gradients came on, and the caller's stream waits for its snapshot
        nbytes = payload_bytes(grads)
        with self._lock:
            self.stats.bytes_received += nbytes
            self.stats.calls += 1
            error = self._check_push(worker, grads, lrs)
            if error is not None:
                return ShardError(error)
            staleness = self.version - self._version_pulled[worker]
            if self.staleness_lr == "inverse" and staleness:
                lrs = [lr / (1 + staleness) for lr in lrs]
            self._order.take(grads)
            with self._order.running():
                self._step([grads], lrs)
                values, sent = self._snapshot(worker) if pull else (None, 0)
            self._order.give(values.flats if values is not None else ())
            self.clocks[worker] += 1
            self.pushes += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
            self.log.append((worker, self.clocks[worker], staleness))
            return AsyncReply(values, self.version, staleness, nbytes + sent)

    def pull(self, worker: int) -> AsyncReply | ShardError:
        """The shard's current values (copies), remembered as worker ``worker``'s base version."""
        with self._lock:
            if not 0 <= worker < self.num_workers:
                return ShardError(
                    f"parameter server shard {self.shard_id}: pull from worker {worker}, expected "
                    f"a worker in [0, {self.num_workers})"
                )
            self.stats.calls += 1
            with self._order.running():
                values, sent = self._snapshot(worker)
            self._order.give(values.flats)
            return AsyncReply(values, self.version, -1, sent)

    def _snapshot(self, worker: int) -> tuple[Packed, int]:
        # a copy (packing copies), made on the shard stream: the next push may update the tensors
        # while this reply is being read or serialised
        self._version_pulled[worker] = self.version
        self.stats.bytes_sent += self._values_bytes
        return pack(self.params), self._values_bytes


def _async_shard(shard_id: int) -> AsyncParameterShard | ShardError:
    shard = hosted_shard(shard_id)
    if not isinstance(shard, AsyncParameterShard):
        return ShardError(
            f"parameter server shard {shard_id} is synchronous; an asynchronous push or pull needs an "
            "AsyncParameterShard (do all ranks use strategy='async'?)"
        )
    return shard


def _rpc_async_push(shard_id: int, worker: int, grads: Packed, lrs: list[float], pull: bool) -> AsyncReply | ShardError:
    shard = _async_shard(shard_id)
    if isinstance(shard, ShardError):
        return shard
    try:
        unpacked = shard.unpack(grads)
    except ValueError as err:
        return ShardError(f"parameter server shard {shard_id}: worker {worker} pushed {err}")
    return shard.push_pull(worker, unpacked, lrs, pull=pull)


def _rpc_async_pull(shard_id: int, worker: int) -> AsyncReply | ShardError:
    shard = _async_shard(shard_id)
    return shard if isinstance(shard, ShardError) else shard.pull(worker)


class AsyncParameterServerClient(ParameterServerClient):
    """A worker's handle on the asynchronous shards (arguments as
    :class:`~lightning_strategies.comm.ps.ParameterServerClient`); ``step`` is its clock: its pushes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_staleness: list[int] = []

    @property
    def clock(self) -> int:
        """Pushes this worker has made."""
        return self.step

    def push(self, grads: Sequence[Tensor | None], lrs: Sequence[float], *, pull: bool) -> None:
        """Push ``grads`` (flat optimizer order) to every shard; copy the answers in when ``pull``. Waits
        for the shards' answers only, never for another worker."""
        start = time.perf_counter()
        replies = self._call_shards(
            _rpc_async_push, lambda idx: (self.worker, self._outgoing(grads, idx), list(lrs), pull)
        )
        self.last_staleness = []
        for s, reply in replies.items():
            self._apply_reply(s, reply)
            self.last_staleness.append(reply.staleness)
        self._end_step(start)

    def pull(self) -> None:
        """Copy every shard's current values into the local parameters."""
        start = time.perf_counter()
        for s, reply in self._call_shards(_rpc_async_pull, lambda idx: (self.worker,)).items():
            self._apply_reply(s, reply)
        self.stats.seconds += time.perf_counter() - start
