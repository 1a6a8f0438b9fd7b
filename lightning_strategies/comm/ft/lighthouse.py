"""The torchft Lighthouse: where it is, whether it answers, and starting one in this process.

The Lighthouse is torchft's quorum service (a Rust server in the ``torchft`` wheel): every replica
group's Manager heartbeats to it and asks it for the quorum of each step. It is the one process
a torchft job cannot lose (quorum retries are off by default), so it runs in the launcher's
process, or stands alone (``torchft_lighthouse``) on a host that outlives the replicas.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LighthouseHandle",
    "LighthouseUnreachableError",
    "check_lighthouse",
    "lighthouse_command",
    "parse_lighthouse",
    "start_lighthouse",
]


class LighthouseUnreachableError(RuntimeError):
    """No torchft Lighthouse answers at the address a replica was given."""


def parse_lighthouse(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"``, ``"http://host:port"`` or ``"[v6]:port"``.

    Raises:
        ValueError: ``address`` names no port.
    """
    rest = address.strip()
    if "://" in rest:
        rest = rest.split("://", 1)[1]
    rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"lighthouse={address!r}: expected 'host:port' (or 'http://host:port'), the address a "
            "`torchft_lighthouse --bind [::]:PORT` listens on. Fix: add the port, e.g. 'node0:29510'."
        )
    return host.strip("[]"), int(port)


def lighthouse_command(min_replicas: int, heartbeat_timeout_s: float, port: int = 29510) -> str:
    """The shell command that starts a Lighthouse matching these settings (for error messages and docs)."""
    return (
        f"torchft_lighthouse --min_replicas {min_replicas} --bind [::]:{port} "
        f"--heartbeat_timeout_ms {round(heartbeat_timeout_s * 1000)} --join_timeout_ms 1000"
    )


def check_lighthouse(address: str, *, timeout_s: float, min_replicas: int = 1, heartbeat_timeout_s: float = 5.0) -> str:
    """Wait up to ``timeout_s`` for a TCP connection to the Lighthouse; return its ``http://`` URL.

    Raises:
        LighthouseUnreachableError: nothing accepted a connection at ``address`` in time; the
            message says which address and the command that starts a Lighthouse there.
    """
    host, port = parse_lighthouse(address)
    deadline = time.monotonic() + max(0.0, timeout_s)
    error: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, timeout_s))):
                return f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise LighthouseUnreachableError(
        f"found no torchft Lighthouse at {host}:{port} ({error}) after {timeout_s:g} s: expected one listening "
        "there, since every replica asks it for the quorum of each step. Fix: start one on that host with "
        f"`{lighthouse_command(min_replicas, heartbeat_timeout_s, port)}`, or leave lighthouse=None so "
        "that the launcher starts one in its own process (single node)."
    )


@dataclass
class LighthouseHandle:
    """A Lighthouse running in this process; :meth:`shutdown` stops it.

    Attributes:
        address: the ``http://host:port`` URL replicas are given.
        server: torchft's ``LighthouseServer``.
    """

    address: str
    server: Any

    def shutdown(self) -> None:
        """Stop the server (idempotent)."""
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def start_lighthouse(
    *,
    min_replicas: int,
    heartbeat_timeout_s: float,
    join_timeout_s: float,
    quorum_tick_ms: int = 10,
    host: str = "127.0.0.1",
    port: int = 0,
) -> LighthouseHandle:
    """Start torchft's ``LighthouseServer`` in this process, listening on every interface.

    Args:
        min_replicas: the smallest quorum it forms.
        heartbeat_timeout_s: silence after which a replica is out of the next quorum: what the
            survivors of a loss stall for.
        join_timeout_s: how long a quorum waits for replicas that heartbeat but have not asked
            yet (a starting or restarting one).
        quorum_tick_ms: how often it checks for a quorum while waiting.
        host: the host name replicas reach it by (advertised, not bound).
        port: ``0``: any free port.
    """
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=round(join_timeout_s * 1000),
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=round(heartbeat_timeout_s * 1000),
    )
    bound = parse_lighthouse(server.address())[1]
    return LighthouseHandle(address=f"http://{host}:{bound}", server=server)
