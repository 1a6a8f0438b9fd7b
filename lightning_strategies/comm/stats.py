"""Communication accounting shared by every algorithm in :mod:`lightning_strategies.comm`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Bytes and time spent communicating, as counted by one process.

    Counts are what *this* process put on / took off the wire (payload bytes, not protocol
    overhead), so summing ``bytes_sent`` over ranks gives the total traffic of a collective.

    Attributes:
        bytes_sent: payload bytes this process sent.
        bytes_received: payload bytes this process received.
        calls: number of communication calls (collectives, pushes, pulls) counted.
        seconds: wall-clock seconds spent inside those calls.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    seconds: float = 0.0

    def __add__(self, other: CommStats) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        return CommStats(
            bytes_sent=self.bytes_sent + other.bytes_sent,
            bytes_received=self.bytes_received + other.bytes_received,
            calls=self.calls + other.calls,
            seconds=self.seconds + other.seconds,
        )

    def __iadd__(self, other: CommStats) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.calls += other.calls
        self.seconds += other.seconds
        return self

    def reset(self) -> CommStats:
        """Zero every counter in place and return a copy of what was counted before."""
        before = CommStats(**asdict(self))
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return before

    def as_dict(self, prefix: str = "comm/") -> dict[str, float]:
        """The counters as floats keyed ``prefix + name``, ready for ``LightningModule.log_dict``."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}
