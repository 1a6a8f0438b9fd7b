"""Communication accounting shared by every algorithm in :mod:`lightning_strategies.comm`."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["CommStats"]

# Counters that are ``None`` until an algorithm that knows the node layout counts them.
_SPLIT = ("inter_node_bytes_sent", "inter_node_bytes_received")


@dataclass
class CommStats:
    """Bytes and time spent communicating, as counted by one process.

    Payload bytes this process put on / took off the wire (no protocol overhead): summed over ranks,
    a collective's traffic.

    Attributes:
        bytes_sent, bytes_received: payload bytes.
        calls: communication calls counted (collectives, pushes, pulls).
        seconds: time inside them (wall time; device time where the algorithm says so).
        inter_node_bytes_sent, inter_node_bytes_received: of the above, with other nodes; ``None``
            unless the algorithm knew the node layout.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    seconds: float = 0.0
    inter_node_bytes_sent: int | None = None
    inter_node_bytes_received: int | None = None

    @property
    def intra_node_bytes_sent(self) -> int | None:
        """Of ``bytes_sent``, those that stayed inside this node (``None``: not split)."""
        return None if self.inter_node_bytes_sent is None else self.bytes_sent - self.inter_node_bytes_sent

    @property
    def intra_node_bytes_received(self) -> int | None:
        """Of ``bytes_received``, those from this node (``None``: not split)."""
        return None if self.inter_node_bytes_received is None else self.bytes_received - self.inter_node_bytes_received

    def __add__(self, other: CommStats) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        out = CommStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        out += other
        return out

    def __iadd__(self, other: CommStats) -> CommStats:
        if not isinstance(other, CommStats):
            return NotImplemented
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is None or theirs is None:  # a split count plus an unsplit one: keep the split part
                setattr(self, f.name, theirs if mine is None else mine)
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def reset(self) -> CommStats:
        """Zero every counter in place (a split one stays split, at 0) and return a copy of what was counted."""
        before = self + CommStats()
        for f in fields(self):
            value = getattr(self, f.name)
            setattr(self, f.name, None if value is None else type(value)())
        return before

    def as_dict(self, prefix: str = "comm/") -> dict[str, float]:
        """The counters as floats keyed ``prefix + name``, ready for ``LightningModule.log_dict``
        (the four node-split keys only when the counts are split)."""
        out = {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in fields(self) if f.name not in _SPLIT}
        if self.inter_node_bytes_sent is not None and self.inter_node_bytes_received is not None:
            for name in (*_SPLIT, "intra_node_bytes_sent", "intra_node_bytes_received"):
                out[f"{prefix}{name}"] = float(getattr(self, name))
        return out
