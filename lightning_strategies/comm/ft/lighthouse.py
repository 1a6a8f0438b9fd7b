"""The torchft Lighthouse: where it is, whether it answers, and starting one as a child process.

The Lighthouse is torchft's quorum service (a Rust server in the ``torchft`` wheel): every replica
group's Manager heartbeats to it and asks it for the quorum of each step. It is the one process
a torchft job cannot lose (quorum retries are off by default), so the launcher starts it in a process of
its own that ends with the launcher (:func:`start_lighthouse`), or it stands alone (``torchft_lighthouse``)
on a host that outlives the replicas.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = [
    "LighthouseHandle",
    "LighthouseUnreachableError",
    "check_lighthouse",
    "lighthouse_command",
    "parse_lighthouse",
    "start_lighthouse",
]

log = logging.getLogger(__name__)


def _connect_error(host: str, port: int, *, timeout_s: float) -> OSError | None:
    """``None`` where something at ``host:port`` accepts a TCP connection now; else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e


def _url(host: str, port: int) -> str:
    return f"http://{host if ':' not in host else f'[{host}]'}:{port}"


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
    while True:
        error = _connect_error(host, port, timeout_s=min(2.0, max(0.1, timeout_s)))
        if error is None:
            return _url(host, port)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise LighthouseUnreachableError(
        f"found no torchft Lighthouse at {host}:{port} ({error}) after {timeout_s:g} s: expected one listening "
        "there, since every replica asks it for the quorum of each step. Fix: start one on that host with "
        f"`{lighthouse_command(min_replicas, heartbeat_timeout_s, port)}`, or leave lighthouse=None so "
        "that the launcher starts one (single node)."
    )


@dataclass
class LighthouseHandle:
    """A Lighthouse this process started (its own process); :meth:`shutdown` stops it.

    Attributes:
        address: the ``http://host:port`` URL replicas are given.
        process: the Lighthouse's process (``None`` once shut down).
    """

    address: str
    process: subprocess.Popen[bytes] | None

    def exit_code(self) -> int | None:
        """``None`` while it runs (or after :meth:`shutdown`); else how its process ended."""
        return None if self.process is None else self.process.poll()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout_s``; idempotent). Where it had ended on its
        own, a warning says so with its exit code (its output went to this process's stderr)."""
        proc, self.process = self.process, None
        if proc is None:
            return
        code = proc.poll()
        if code is not None:
            log.warning(f"ft: the Lighthouse at {self.address} had ended on its own (exit {code}) before its "
                        "shutdown; its output is on stderr")  # fmt: skip
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def _free_port() -> int:
    """A port free now on every interface (the Lighthouse binds ``[::]``; IPv4 where the host has no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
            return int(s.getsockname()[1])
    except OSError:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])


def start_lighthouse(
    *,
    min_replicas: int,
    heartbeat_timeout_s: float,
    join_timeout_s: float,
    quorum_tick_ms: int = 10,
    host: str = "127.0.0.1",
    port: int = 0,
    start_timeout_s: float = 60.0,
) -> LighthouseHandle:
    """Start torchft's Lighthouse in a process of its own, listening on every interface; its log lines go to
    this process's stderr, as the server's did when it ran inside it.

    Its own process, not a server in this one: a launcher died of SIGSEGV three times in full test suites while
    the in-process server's threads ran next to its Python ones (in a pure-Python frame, cause unknown). The
    process ends with the thread that called this (Linux: ``PR_SET_PDEATHSIG``), and :meth:`LighthouseHandle.shutdown`
    ends it before.

    Args:
        min_replicas: the smallest quorum it forms.
        heartbeat_timeout_s: silence after which a replica is out of the next quorum: what the
            survivors of a loss stall for.
        join_timeout_s: how long a quorum waits for replicas that heartbeat but have not asked
            yet (a starting or restarting one).
        quorum_tick_ms: how often it checks for a quorum while waiting.
        host: the host name replicas reach it by (advertised, not bound).
        port: ``0``: a free port (picked here; taken meanwhile by another process, the next one is tried).
        start_timeout_s: how long to wait for it to accept connections.

    Raises:
        RuntimeError: it ended, or did not accept connections, within ``start_timeout_s`` (its output is on
            stderr).
    """
    from lightning_strategies.comm.ft import _lighthouse_main

    deadline = time.monotonic() + start_timeout_s
    env = dict(os.environ, **{_lighthouse_main.PARENT_ENV: str(os.getpid())})
    attempts = 1 if port else 3
    for attempt in range(attempts):
        chosen = port or _free_port()
        argv = [sys.executable, _lighthouse_main.__file__, "--min_replicas", str(min_replicas), "--bind",
                f"[::]:{chosen}", "--join_timeout_ms", str(round(join_timeout_s * 1000)), "--quorum_tick_ms",
                str(quorum_tick_ms), "--heartbeat_timeout_ms", str(round(heartbeat_timeout_s * 1000))]  # fmt: skip
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
        while proc.poll() is None and time.monotonic() < deadline:
            if _connect_error("127.0.0.1", chosen, timeout_s=1.0) is None:
                return LighthouseHandle(address=_url(host, chosen), process=proc)
            time.sleep(0.01)
        code = proc.poll()
        if code is None:  # the deadline
            proc.kill()
            proc.wait(timeout=10.0)
        if code is None or attempt == attempts - 1 or time.monotonic() >= deadline:
            what = f"ended with {code}" if code is not None else f"accepted no connection within {start_timeout_s:g} s"
            raise RuntimeError(f"torchft's Lighthouse ({' '.join(argv[1:])}) {what}; its output is on stderr")
        # it ended at once: maybe the port picked here was taken before it bound it; another one
    raise AssertionError("unreachable: the last attempt raises")
