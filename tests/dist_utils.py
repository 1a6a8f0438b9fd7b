"""The multi-process test runner; it lives in ``benchmarks/_workers.py``, shared with the benchmarks."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from benchmarks._workers import free_port, run_workers

__all__ = ["free_port", "reserved_port", "run_workers"]

_handed_out: set[int] = set()


def reserved_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, below the kernel's ephemeral range.

    :func:`free_port` asks the kernel for an ephemeral port: right for a port bound at once, but one
    picked for a process started a minute later may meanwhile be handed out again, as another
    socket's ``bind(0)`` or as the local end of an outgoing connection (gloo and TensorPipe open
    many): the store then fails with EADDRINUSE. The kernel never picks a port below its ephemeral
    range by itself, so one free there stays free until someone binds it by number; the ports this
    process handed out are never repeated.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)  # not the seeded global generator: other test processes differ
    for port in candidates:
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in [{max(1024, low - 12000)}, {low}) on 127.0.0.1")
