"""One torchft replica group of one process: its Manager, its store, and the state it heals from.

Every process is a replica group of size 1: torchft's :class:`~torchft.manager.Manager` with a
process group (gloo on CPU, NCCL on CUDA) that it reconfigures at every new quorum, a TCPStore of
its own for that group, and state-dict hooks that a recovering replica's Manager fetches from a
live peer (over torchft's HTTP checkpoint transport) and loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ReplicaConfig", "ReplicaGroup", "snapshot"]


def snapshot(value: Any) -> Any:
    """``value`` with every tensor cloned, through dicts, lists and tuples.

    torchft's HTTP transport serves CPU tensors as they are, while the sender trains on: a state
    dict handed to it must not share storage with the live weights, buffers or optimizer state.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return (
            type(value)((k, snapshot(v)) for k, v in value.items())
            if isinstance(value, dict)
            else {k: snapshot(v) for k, v in value.items()}
        )
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return value


@dataclass(frozen=True)
class ReplicaConfig:
    """How a replica talks to the Lighthouse and to its peers.

    Attributes:
        min_replicas: a step commits only when at least this many replicas take part.
        timeout_s: collectives, ``should_commit`` and checkpoint transfers give up after this.
        quorum_timeout_s: how long a replica waits for a quorum (a restart must join within it).
        connect_timeout_s: connecting to the Lighthouse and to a peer's Manager.
        heartbeat_interval_s: how often the Manager heartbeats to the Lighthouse.
        init_sync: at step 0 every replica but one heals from it (weights equal from the start,
            whatever each replica's seed).
    """

    min_replicas: int = 1
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    heartbeat_interval_s: float = 0.1
    init_sync: bool = True

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(
                f"min_replicas={self.min_replicas}: expected >= 1 (a step needs at least one replica). "
                "Fix: pass min_replicas=1 to go on with any survivor."
            )
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s", "heartbeat_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0. Fix: pass e.g. 30.")


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


class ReplicaGroup:
    """This process's torchft Manager (replica group of size 1) and the state it serves and heals.

    Args:
        config: timeouts and ``min_replicas``.
        lighthouse: the Lighthouse's ``http://host:port``.
        replica_id: this replica's name; a restart reuses it (the Manager adds a fresh UUID).
        device: the training device: gloo on CPU, NCCL on CUDA.
        hostname: the address peers reach this replica's Manager and checkpoint server by.
    """

    def __init__(
        self, config: ReplicaConfig, *, lighthouse: str, replica_id: str, device: torch.device, hostname: str
    ) -> None:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from lightning_strategies.comm.ft.transport import AdvertisedHTTPTransport

        self.config = config
        self._loaders: dict[str, Callable[[Any], None]] = {}
        self._savers: dict[str, Callable[[], Any]] = {}
        self.heals = 0
        # the Manager connects to its replica group's store as a client: this process serves it
        self._store = dist.TCPStore(
            host_name=hostname, port=0, is_master=True, wait_for_workers=False, timeout=_seconds(config.timeout_s)
        )
        pg = (
            ProcessGroupNCCL(timeout=_seconds(config.timeout_s))
            if device.type == "cuda"
            else ProcessGroupGloo(timeout=_seconds(config.timeout_s))
        )
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._save,
            min_replica_size=config.min_replicas,
            # sync quorum: a recovering replica loads its state before the step's forward, and DiLoCo requires it
            use_async_quorum=False,
            timeout=_seconds(config.timeout_s),
            quorum_timeout=_seconds(config.quorum_timeout_s),
            connect_timeout=_seconds(config.connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=hostname,
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=hostname,
            heartbeat_interval=_seconds(config.heartbeat_interval_s),
            init_sync=config.init_sync,
            # a healing peer fetches from `hostname` (torchft's own transport names the host name)
            checkpoint_transport=AdvertisedHTTPTransport(hostname=hostname, timeout=_seconds(config.timeout_s)),
        )

    def register(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """Serve ``save()`` (snapshotted) under ``key`` to recovering peers; ``load`` it when this one heals."""
        if key in self._savers:
            raise ValueError(f"state key {key!r} is registered twice: expected each key once. Fix: rename one.")
        self._loaders[key], self._savers[key] = load, save

    def _save(self) -> dict[str, Any]:
        return {key: snapshot(save()) for key, save in self._savers.items()}

    def _load(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self._loaders) - set(state))
        if missing:
            raise RuntimeError(
                f"healing found the peer's state without {missing}: expected the keys {sorted(self._loaders)}. "
                "Fix: run every replica with the same strategy and options."
            )
        for key, load in self._loaders.items():
            load(state[key])
        self.heals += 1

    def start_quorum(self) -> bool:
        """Join the next quorum (blocking); heal from a peer if this replica is behind. Returns
        whether this call healed."""
        before = self.heals
        self.manager.start_quorum()
        return self.heals != before

    @property
    def step(self) -> int:
        """Steps this replica group has committed (a healed one: its source's)."""
        return int(self.manager.current_step())

    def participants(self) -> int:
        """Replicas in the current quorum."""
        return int(self.manager.num_participants())

    def shutdown(self) -> None:
        """Stop the Manager's server and checkpoint transport without waiting for peers."""
        self.manager.shutdown(wait=False)
