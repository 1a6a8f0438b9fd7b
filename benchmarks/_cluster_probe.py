"""Link probes for ``benchmarks/scale_cluster.py`` and the shaping test, run inside an emulated node.

    _cluster_probe.py stream-recv HOST PORT         accept one TCP stream, read to EOF; print JSON
    _cluster_probe.py stream-send HOST PORT SECONDS  send zeros for SECONDS; print JSON (bytes sent)
    _cluster_probe.py echo HOST PORT                 echo every message back until EOF
    _cluster_probe.py ping HOST PORT COUNT           COUNT 64-byte round trips; print JSON

The stream's receiver reports the payload bytes per second from ``SKIP_S`` after its first byte
on (TCP's slow start and HTB's burst left out); the ping reports the median round trip of a small
message (TCP_NODELAY, so no Nagle delay), whose half is the link's one-way latency.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

CHUNK = 1 << 16
SKIP_S = 0.5
PING_BYTES = 64


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _accept(host: str, port: int) -> socket.socket:
    with socket.create_server((host, port)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def stream_recv(host: str, port: int) -> None:
    with _accept(host, port) as conn:
        total, first, last, skip_bytes, skip_t = 0, 0.0, 0.0, 0, 0.0
        while data := conn.recv(CHUNK):
            now = time.perf_counter()
            if not total:
                first = now
            total += len(data)
            last = now
            if not skip_t and now - first >= SKIP_S:
                skip_bytes, skip_t = total, now
    steady_bytes, steady_seconds = total - skip_bytes, last - skip_t
    print(json.dumps({"bytes": total, "seconds": last - first, "steady_bytes": steady_bytes,
                      "steady_seconds": steady_seconds, "goodput": steady_bytes / max(steady_seconds, 1e-9)}))


def stream_send(host: str, port: int, seconds: float) -> None:
    payload = b"\0" * CHUNK
    sent = 0
    with _connect(host, port) as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
            sent += len(payload)
    print(json.dumps({"sent": sent}))


def _read(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return buf
        buf += part
    return buf


def echo(host: str, port: int) -> None:
    with _accept(host, port) as conn:
        while len(msg := _read(conn, PING_BYTES)) == PING_BYTES:
            conn.sendall(msg)


def ping(host: str, port: int, count: int) -> None:
    msg = b"\1" * PING_BYTES
    rtts = []
    with _connect(host, port) as conn:
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(msg)
            _read(conn, PING_BYTES)
            rtts.append(time.perf_counter() - start)
    print(json.dumps({"rtt_median": statistics.median(rtts), "rtt_min": min(rtts), "count": count}))


if __name__ == "__main__":
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "stream-recv":
        stream_recv(host, port)
    elif mode == "stream-send":
        stream_send(host, port, float(sys.argv[4]))
    elif mode == "echo":
        echo(host, port)
    else:
        ping(host, port, int(sys.argv[4]))
