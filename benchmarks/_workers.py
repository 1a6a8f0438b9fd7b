"""Run a function in P fork-started processes joined by a gloo process group on 127.0.0.1.

Shared by the benchmarks and the multi-process tests (``tests/dist_utils.py`` re-exports it).

Every wait is bounded: a worker that hangs or dies makes :func:`run_workers` kill the
processes *it* started (by PID) and raise, so a broken collective fails a test instead of
hanging CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_handed_out: set[int] = set()


def reserved_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, below the kernel's ephemeral range.

    The port every launcher here passes on to processes it starts (a store's, torchrun's, a heartbeat's).
    An ephemeral port (``bind(0)``, then closed) is right only for a port bound at once: one
    picked for a process started a moment later may meanwhile be handed out again, as another
    socket's ``bind(0)`` or as the local end of an outgoing connection (gloo and TensorPipe open
    many): the store then fails with EADDRINUSE. The kernel never picks a port below its ephemeral
    range by itself, so one free there stays free until someone binds it by number; the ports this
    process handed out are never repeated.

    Under pytest-xdist each worker (``PYTEST_XDIST_WORKER`` ``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``,
    inherited by the processes its tests start) takes only the ports equal to ``i`` modulo the count, so two
    tests running side by side never pick the same one.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    candidates = list(range(max(1024, low - 12000), low))
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        candidates = [p for p in candidates if p % int(count) == int(worker[2:]) % int(count)]
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


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    pg_timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(
    target: Callable[..., None],
    world: int,
    rank_args: Callable[[int, int, Any], tuple[Any, ...]],
    start_method: str = "fork",
) -> tuple[Any, list[Any]]:
    """Start ``world`` daemon processes, rank r running ``target(*rank_args(r, port, results))``.

    ``port``: one :func:`reserved_port` for their store, picked now and bound by rank 0 a moment later;
    ``results``: a queue of the start method's context they answer on. Returns ``(results, processes by rank)``;
    end them with :func:`end_ranks`.
    """
    ctx: Any = mp.get_context(start_method)  # fork, spawn or forkserver: one Process API
    results = ctx.Queue()
    port = reserved_port()
    procs = [ctx.Process(target=target, args=rank_args(r, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return results, procs


def end_ranks(procs: list[Any], *, join_timeout_s: float) -> None:
    """Join every process of :func:`start_ranks`; one still alive after ``join_timeout_s`` is SIGKILLed (by its PID)."""
    for p in procs:
        p.join(timeout=join_timeout_s)
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout_s: float = 60.0,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results by rank.

    ``fn`` must be picklable only in spirit: processes are forked, so closures work too. A process
    that has used CUDA cannot fork one that uses it: GPU tests pass ``start_method="spawn"`` (then
    ``fn`` and ``args`` must pickle: a module-level function).
    Raises ``RuntimeError`` with every failing rank's traceback, or ``TimeoutError`` (after
    killing the workers) when they do not all finish within ``timeout`` seconds.
    """
    results, procs = start_ranks(
        _worker, world_size, lambda r, port, q: (r, world_size, port, fn, args, q, pg_timeout_s), start_method
    )
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{world_size - len(out) - len(errors)} of {world_size} workers did not finish "
                    f"within {timeout:.0f}s (finished: {sorted(out)}, failed: {sorted(errors)})"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                missing = [r for r in dead if r not in out and r not in errors]
                if missing:
                    errors.update({r: f"process exited with code {procs[r].exitcode}" for r in missing})
                continue
            (out if status == "ok" else errors)[rank] = value
    finally:
        end_ranks(procs, join_timeout_s=5)
    if errors:
        raise RuntimeError(
            "\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [out[r] for r in range(world_size)]
