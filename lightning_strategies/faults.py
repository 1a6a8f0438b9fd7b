"""The Lightning-facing side of the heartbeat diagnosis: naming the rank that was lost in a fit.

The heartbeats and the diagnosis live in :mod:`lightning_strategies.comm.heartbeat` (Lightning-free); this
package's strategies use them through :class:`PeerFailureMixin`, any other strategy through the callback
:class:`PeerFailureReport`. The heartbeat's names a fit's code needs are re-exported here
(``from lightning_strategies.faults import PeerLostError`` keeps working).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from typing_extensions import override

from lightning_strategies.comm.heartbeat import (
    DEFAULT_INTERVAL,
    GRACE_INTERVALS,
    Heartbeat,
    PeerDiagnosis,
    PeerLostError,
    abort_communication,
    annotate_peer_failure,
    failure_reason,
    is_reported,
    raise_peer_lost,
    start_heartbeat,
)

__all__ = [
    "DEFAULT_INTERVAL",
    "GRACE_INTERVALS",
    "Heartbeat",
    "PeerDiagnosis",
    "PeerFailureMixin",
    "PeerFailureReport",
    "PeerLostError",
    "abort_communication",
    "annotate_peer_failure",
    "start_heartbeat",
    "strategy_label",
]


def strategy_label(strategy: Strategy) -> str:
    """The name a user knows the strategy by: ``strategy_name``, else the class name (``"ddp"``)."""
    name = getattr(strategy, "strategy_name", None)
    return str(name) if name else type(strategy).__name__.removesuffix("Strategy").lower()


class PeerFailureMixin(DDPStrategy):
    """Put first in the bases of a ``DDPStrategy`` subclass: lost peers are named on failure.

    Starts a :class:`Heartbeat` once the process group exists, raises :class:`PeerLostError` when ``optimizer_step``
    (which runs Lightning's closure) or ``training_step`` fails because a peer is gone, adds the diagnosis as a note
    to any other error Lightning re-raises (``on_exception``), such as a failed barrier or checkpoint broadcast, and
    stops the heartbeat at teardown. A subclass whose ``optimizer_step`` does not call ``super()`` wraps its body in
    ``with self._peer_watch():``. A peer silent for :attr:`peer_watch_grace` seconds (frozen, or dead where NCCL
    does not notice) makes the heartbeat's watch abort this rank's communication
    (:func:`~lightning_strategies.comm.heartbeat.abort_communication`), so the blocked step raises
    :class:`PeerLostError` long before the process group's timeout.
    """

    _peer_heartbeat: Heartbeat | None = None
    #: Seconds a peer may stay silent while the job runs before this rank aborts its communication
    #: (``None``: ``DEFAULT_WATCH_GRACE``, 60 s; ``0``: no watch, a frozen peer waits out ``timeout``).
    #: Keep it below the strategy's ``timeout``, or NCCL's watchdog acts first, naming nobody.
    peer_watch_grace: float | None = None

    @property
    def peer_heartbeat(self) -> Heartbeat | None:
        """This rank's heartbeat (``None`` before the process group, with one process, or after teardown)."""
        return self._peer_heartbeat

    def _peer_watch(self) -> AbstractContextManager[None]:
        """A block whose error becomes :class:`PeerLostError` when a peer turns out to be gone."""
        return raise_peer_lost(lambda: self._peer_heartbeat, lambda: strategy_label(self))

    def _stop_heartbeat(self, *, finished: bool = True) -> None:
        """Stop and drop this rank's heartbeat, if any (``finished=False``: not a clean end)."""
        if self._peer_heartbeat is not None:
            self._peer_heartbeat.stop(finished=finished)
            self._peer_heartbeat = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._stop_heartbeat(finished=False)
        self._peer_heartbeat = start_heartbeat(self.global_rank, self.world_size, watch_grace=self.peer_watch_grace)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._peer_watch():
            return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._peer_watch():
            return super().optimizer_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        beat = self._peer_heartbeat
        if beat is not None and isinstance(exception, Exception) and not is_reported(exception):
            beat.report_failure(failure_reason(exception))  # first, so that peers diagnosing now learn it
        super().on_exception(exception)  # the strategy's own clean-up first (it may unblock peers)
        annotate_peer_failure(exception, beat, strategy_label(self))

    @override
    def teardown(self) -> None:
        super().teardown()
        self._stop_heartbeat()


class PeerFailureReport(Callback):
    """Name the lost peer in the error of any strategy (Lightning's ``ddp``, FSDP, ...).

    Starts a heartbeat per rank at setup (fit, validate, test or predict) and adds the diagnosis to an exception as a
    note, e.g. ``"ddp: lost peer rank 1 of 2: no heartbeat for 2.5 s ..."``. Its watch works as in
    :class:`PeerFailureMixin`: a blocked collective fails instead of waiting for the process group's timeout. With a
    strategy of this package (which keeps its own heartbeat) it does nothing, so adding it to every run is safe.

    Args:
        interval: seconds between heartbeats.
        watch_grace: see :attr:`PeerFailureMixin.peer_watch_grace` (``None``: 60 s; ``0``: no watch).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL, watch_grace: float | None = None) -> None:
        self.interval = interval
        self.watch_grace = watch_grace
        self._heartbeat: Heartbeat | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(finished=False)
            self._heartbeat = None
        if not isinstance(trainer.strategy, PeerFailureMixin):
            self._heartbeat = start_heartbeat(
                trainer.global_rank, trainer.world_size, interval=self.interval, watch_grace=self.watch_grace
            )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a strategy with its own heartbeat diagnoses in its own on_exception, after its clean-up
        annotate_peer_failure(exception, self._heartbeat, strategy_label(trainer.strategy))
        if self._heartbeat is not None:  # Lightning calls no teardown hook after an exception
            self._heartbeat.stop(finished=False)  # the peers read this rank's failure mark now
            self._heartbeat = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
