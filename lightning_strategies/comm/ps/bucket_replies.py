"""The overlapped push to shards that answer each bucket on its own (no Lightning import).

With ``reply_per_part`` (:class:`~lightning_strategies.comm.ps.ParameterShard`) a shard steps the slices of a
bucket as soon as every worker has pushed them and answers that push with their new values; with the shard plan
split per bucket (:func:`~lightning_strategies.comm.ps.partition_per_group`) every shard holds part of every
bucket, so the shards complete a bucket together. The values then land per bucket, as the hierarchical push's
(:mod:`.hierarchy_overlap`): each module's forward pre-hook waits only for the replies of its own tensors'
bucket, from every shard holding part of it, the last bucket (the first layers) first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from torch.futures import Future

from lightning_strategies.comm.ps.buckets import OverlappedPush

__all__ = ["BucketwisePush"]


class BucketwisePush(OverlappedPush):
    """:class:`OverlappedPush` whose values land per bucket (the shards answer each bucket's push).

    Args: as :class:`OverlappedPush`'s; every shard must answer each part with that part's values.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replies: dict[int, dict[int, Future[Any]]] = {}  # this step's, per bucket and shard
        self._landing: dict[int, dict[int, Future[Any]]] = {}  # the last step's not yet landed
        self._step_bytes: dict[int, int] = {}  # per shard, the largest bytes of the last step's replies so far

    def _push(self, b: int) -> None:
        super()._push(b)
        # the push of each shard's part of bucket b is the last future made for that shard
        self._replies[b] = {s: self._parts[s][-1] for s in self.buckets[b].parts}

    def flush(self) -> None:
        """As ``OverlappedPush``'s; every bucket's values are then due."""
        replies = self._replies
        super().flush()
        self._landing, self._replies, self._step_bytes = replies, {}, {}
        self._stale = {i for b in self._landing for i in self.buckets[b].tensors}

    def _due_units(self) -> AbstractSet[int]:
        return self._landing.keys()

    def _units_of(self, tensors: Iterable[int]) -> set[int]:
        return {self._bucket_of[i] for i in tensors if i in self._bucket_of}

    def _land_units(self, units: set[int]) -> None:
        start = time.perf_counter()
        client = self.client
        try:
            timeline = self.timeline[-1]
            for b in sorted(units, reverse=True):  # the last bucket holds the first layers
                for s, reply in client._wait_all(self._landing[b], abort=self._aborted).items():
                    client._apply_reply(s, reply, reply.part)
                    self._step_bytes[s] = max(self._step_bytes.get(s, 0), reply.step_bytes)
                    client.last_server_bytes[s] = self._step_bytes[s]
                del self._landing[b]
                timeline.pull_landed[b] = time.perf_counter()
        except BaseException:
            self.drop()
            raise
        if not self._landing:
            self._in_flight = {}  # every shard's replies landed
        self._stale = {i for i in self._stale if self._bucket_of[i] in self._landing}
        waited = time.perf_counter() - start
        client.last_wait_seconds = waited
        client.stats.seconds += waited

    def drop(self) -> None:
        """Forget the replies and pushes in flight (the run failed: they may never come)."""
        super().drop()
        self._replies, self._landing, self._step_bytes = {}, {}, {}
