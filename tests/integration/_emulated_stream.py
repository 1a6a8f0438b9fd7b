"""One TCP stream for ``test_emulated_cluster.py``'s shaping test, run inside an emulated node.

    _emulated_stream.py recv HOST PORT          accept one connection, read to EOF; print JSON
    _emulated_stream.py send HOST PORT SECONDS  connect (retrying while the receiver starts), send for SECONDS

The receiver prints the bytes it read and the seconds between its first and last read, and the
same from 0.5 s after the first byte on (TCP's slow start and HTB's burst left out).
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 16
SKIP_S = 0.5


def recv(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            total, first, last = 0, 0.0, 0.0
            skip_bytes, skip_t = 0, 0.0
            while data := conn.recv(CHUNK):
                now = time.perf_counter()
                if not total:
                    first = now
                total += len(data)
                last = now
                if not skip_t and now - first >= SKIP_S:
                    skip_bytes, skip_t = total, now
    print(json.dumps({"bytes": total, "seconds": last - first,
                      "steady_bytes": total - skip_bytes, "steady_seconds": last - skip_t}))  # fmt: skip


def send(host: str, port: int, seconds: float) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    sent = 0
    with conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
            sent += len(payload)
    print(json.dumps({"sent": sent}))


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
