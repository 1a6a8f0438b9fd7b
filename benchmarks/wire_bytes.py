"""Bytes on the wire: what crosses the sockets per step, counted by the kernel, against the formulas.

``ps_traffic.py`` and ``allreduce.py`` count *payload* the way the strategies account it
(``numel x itemsize`` of what they hand to the transport); measured over formula is 1.00 there by
construction. This script reads the kernel's own counters instead. P fork-started CPU processes
(one torch thread each) run one communication step of each strategy's comm layer, driven
directly (no Lightning: no heartbeats, logging or loss all-reduce on the sockets, so the only
traffic between the two readings is the step's):

    ddp        ``torch.distributed.all_reduce`` of N float32 on the gloo group, the call DDP's
               reducer makes per bucket. torch's gloo backend leaves gloo's algorithm unspecified,
               which gloo runs as its ring (reduce-scatter + all-gather in segments, one chunk per
               rank: gloo/allreduce.cc); formula 2(P-1)/P x N x 4 sent per rank
    ring       ``lightning_strategies.comm.ring.ring_all_reduce`` of the same N float32 (what the
               "ring" strategy's DDP hook runs per bucket); formula 2(P-1)/P x N x 4
    ring_bf16  the same with ``wire_dtype="bf16"``; formula 2(P-1)/P x N x 2
    ps         ``ParameterServerClient.push_pull`` with S = P shards co-located (rank s hosts shard
               s), N float32 in ResNet-50's 161 tensor shapes scaled down, SGD on the shards.
               Rank r pushes the N - n_r floats of the remote shards and its shard answers the
               P-1 remote workers with its n_r values: formula 4 (N - n_r) + 4 (P-1) n_r, which is
               2(P-1)/P x N x 4 for balanced shards, as the ring (the co-located push/pull is a
               function call and never touches a socket)
    ps_1       the same with S = 1 (rank 0 hosts everything: the seed's single server). Rank 0
               sends 4 (P-1) N and receives as much, a worker sends 4 N: the server carries P x N
               x 4 each way, of which its own worker's share stays in the process

Counters: ``ss -tinpH`` lists every TCP connection with its owning PID and the kernel's
``tcp_info`` counters: ``bytes_sent`` is the TCP payload a socket has transmitted (TCP/IP headers
excluded, retransmissions included), ``bytes_retrans`` the retransmitted part. The kernel does
retransmit on loopback too (up to a few hundred kB per step on the shared 2-core machine, varying
run to run), so a worker's figure is ``bytes_sent - bytes_retrans``, every payload byte once, and
the retransmissions get a line of their own.

After one warm-up step (the lazily opened gloo pairs and TensorPipe connections exist by then)
the workers wait on a ``multiprocessing.Barrier`` (semaphores, no socket) while rank 0 reads
``ss``; they run k steps, wait again, rank 0 reads again, and only then tear down. Every message
of the k steps has been received when the last rank leaves the barrier, so the counters are
final. Per worker: the difference of ``bytes_sent - bytes_retrans`` between the readings, / k,
summed over its connections to the other workers, found by pairing each socket with the socket at
its far end (the peer's PID). Connections to the rendezvous stores (the gloo group's
``MASTER_PORT``, RPC's ``init_method`` port) are counted apart (``store_bytes_per_step``,
expected 0: nothing uses a store during the steps) and left out of the per-worker figure, as is
everything of processes this script did not start.

TensorPipe picks its transport by what the peers share: on one host it uses shared memory
(``shm``) and cross-memory attach (``cma``), and a loopback socket would see nothing of the
payload. The ps runs therefore pin the ``uv`` (TCP) transport and the ``basic`` channel, which
is how tensors travel between hosts; ``ps_shm_bytes`` shows the same step with TensorPipe's own
choice (the package's ``init_rpc``), i.e. how little of a one-host run crosses a socket.

Lines (per step, per worker, P = 2 and 3):

    wire_bytes_sent_per_step_{s}_P{P}      mean over workers of the measured bytes sent
    wire_bytes_sent_per_step_max_{s}_P{P}  the busiest worker's
    formula_bytes_sent_per_step_{s}_P{P}   the formula's mean over workers (payload only)
    wire_over_formula_{s}_P{P}             measured / formula, summed over workers     goal [0.9, 2.0]
    wire_over_formula_max_{s}_P{P}         the largest per-worker measured / formula
    wire_overhead_{s}_P{P}                 (measured / payload - 1), in %: framing and headers
    wire_overhead_bytes_per_step_{s}_P{P}  measured - payload, bytes (mean over workers)
    wire_overhead_per_tensor_{ps,ps_1}_P{P}  that / tensors sent per step (TensorPipe frames each)
    wire_bytes_received_per_step_ps_1_P{P}_server   what the single server received (formula 4 (P-1) N)
    store_bytes_per_step_{s}_P{P}          the stores' connections, all workers (not in the above)
    retrans_bytes_per_step_{s}_P{P}        retransmitted bytes, all workers (not in the above)
    ps_shm_bytes_sent_per_step_P{P}        ps with TensorPipe's default transports: bytes on sockets

    python benchmarks/wire_bytes.py           # N ~ 6.4M floats, P = 2, 3 (~2-3 min on 2 cores)
    python benchmarks/wire_bytes.py --quick   # N ~ 0.2M floats, P = 2 (seconds, for CI)
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, pyplot, save_figure
from benchmarks._workers import run_workers
from benchmarks.ps_traffic import resnet50_sizes
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    register_shard,
    shard_parameters,
    unregister_shard,
)
from lightning_strategies.comm.ring import ring_all_reduce
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc, store_url, worker_name

CASES = ("ddp", "ring", "ring_bf16", "ps", "ps_1")
GOAL = (0.9, 2.0)  # wire / formula: above 1 by framing only; far off means a wrong formula or count
_WAIT_S = 120.0  # every barrier wait is bounded

# --------------------------------------------------------------------------------------------
# The kernel's counters
# --------------------------------------------------------------------------------------------

_HEAD = re.compile(r"^(?P<state>\S+)\s+\d+\s+\d+\s+(?P<local>\S+)\s+(?P<peer>\S+)(?:\s+users:\((?P<users>.*)\))?")
_PID = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_received|bytes_retrans):(\d+)")


@dataclass(frozen=True)
class Socket:
    """One end of a TCP connection as ``ss`` shows it."""

    local: str
    peer: str
    pid: int | None
    sent: int
    received: int
    retrans: int = 0


def _endpoint(addr: str) -> str:
    """``[::ffff:127.0.0.1]:5000`` and ``127.0.0.1:5000`` name the same end: keep ``127.0.0.1:5000``."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]").removeprefix("::ffff:")
    return f"{host}:{port}"


def parse_ss(text: str) -> dict[tuple[str, str], Socket]:
    """``ss -tinpH`` output -> sockets keyed by (local, peer) endpoints.

    ``ss -i`` prints each connection on a head line (state, queues, addresses, owning processes)
    followed by indented lines of ``tcp_info``; a counter that is still 0 is left out.
    """
    sockets: dict[tuple[str, str], Socket] = {}
    head: re.Match[str] | None = None
    info: list[str] = []

    def flush() -> None:
        if head is None:
            return
        counters = dict(_COUNTER.findall(" ".join(info)))
        pids = _PID.findall(head["users"] or "")
        local, peer = _endpoint(head["local"]), _endpoint(head["peer"])
        sockets[(local, peer)] = Socket(
            local,
            peer,
            int(pids[0]) if pids else None,
            int(counters.get("bytes_sent", 0)),
            int(counters.get("bytes_received", 0)),
            int(counters.get("bytes_retrans", 0)),
        )

    for raw in text.splitlines():
        if not raw.strip():
            continue
        if raw[0].isspace():
            info.append(raw)
            continue
        flush()
        head, info = _HEAD.match(raw), []
    flush()
    return sockets


def read_sockets() -> dict[tuple[str, str], Socket]:
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True)
    return parse_ss(out.stdout)


@dataclass
class Traffic:
    """Bytes per step of one run, by worker rank."""

    sent: list[float]  # to the other workers
    received: list[float]
    store: float  # all workers' store connections, both directions
    connections: int  # worker-to-worker sockets seen
    retrans: float = 0.0  # retransmitted bytes, all workers (left out of ``sent``)


def traffic(
    before: dict[tuple[str, str], Socket],
    after: dict[tuple[str, str], Socket],
    pids: Sequence[int],
    store_ports: set[str],
    steps: int,
) -> Traffic:
    """Per-step bytes each worker sent to and received from the other workers, between two readings."""
    rank_of = {pid: r for r, pid in enumerate(pids)}
    world = len(pids)
    sent, received = [0.0] * world, [0.0] * world
    store, retrans, connections = 0.0, 0.0, 0
    for key, end in after.items():
        if end.pid not in rank_of:
            continue
        old = before.get(key)
        if old is not None and old.pid != end.pid:
            old = None  # the port was reused by another connection between the readings
        d_sent = end.sent - (old.sent if old else 0)
        d_recv = end.received - (old.received if old else 0)
        d_retrans = end.retrans - (old.retrans if old else 0)
        if {end.local.rpartition(":")[2], end.peer.rpartition(":")[2]} & store_ports:
            store += (d_sent + d_recv) / steps
            continue
        far = after.get((end.peer, end.local))
        if far is None or far.pid not in rank_of or far.pid == end.pid:
            continue  # not a connection between two of our workers
        r = rank_of[end.pid]
        # each payload byte once: a retransmission on loopback is the machine's load, not the protocol
        sent[r] += (d_sent - d_retrans) / steps
        received[r] += d_recv / steps
        retrans += d_retrans / steps
        connections += 1
    gone = [k for k, s in before.items() if s.pid in rank_of and k not in after]
    if gone:
        raise RuntimeError(f"{len(gone)} worker connections closed between the readings: {gone[:4]}")
    return Traffic(sent, received, store, connections, retrans)


# --------------------------------------------------------------------------------------------
# The workers
# --------------------------------------------------------------------------------------------


def _init_rpc_tcp(rank: int, world: int, store: dist.Store, timeout: datetime.timedelta) -> None:
    """TensorPipe over TCP only (``uv`` transport, ``basic`` channel), as between two hosts."""
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=2,
        rpc_timeout=timeout.total_seconds(),
        init_method=store_url(store),
        _transports=["uv"],
        _channels=["basic"],
    )
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options)


def _setup(
    case: str, rank: int, world: int, sizes: Sequence[int]
) -> tuple[Callable[[], None], Callable[[bool], None], int | None]:
    """The step to measure, the teardown and RPC's rendezvous port (ps cases), for ``case`` on this rank."""
    n = sum(sizes)
    if case in ("ddp", "ring", "ring_bf16"):
        flat = torch.full((n,), 1e-3 * (rank + 1))
        wire = "bf16" if case == "ring_bf16" else None

        def reduce_step() -> None:
            if case == "ddp":
                dist.all_reduce(flat)
            else:
                ring_all_reduce(flat, wire_dtype=wire, check_peers=False)

        return reduce_step, (lambda failed: None), None
    timeout = datetime.timedelta(seconds=_WAIT_S)
    store = rendezvous_store(rank, world, "127.0.0.1", timeout=timeout)
    if case == "ps_shm":
        init_rpc(rank, world, store, timeout=timeout, num_threads=2)
    else:
        _init_rpc_tcp(rank, world, store, timeout)
    num_servers = 1 if case == "ps_1" else world
    params = [torch.zeros(s, requires_grad=True) for s in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3 * (rank + 1))
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1))
    plan = shard_parameters(list(sizes), num_servers)
    if rank < num_servers:
        register_shard(ParameterShard(rank, plan[rank], [params[i] for i in plan[rank]], spec, world, timeout=timeout))
    dist.barrier()  # every shard is registered before the first push reaches it
    client = ParameterServerClient(rank, params, plan, timeout=timeout)

    def teardown(failed: bool) -> None:
        unregister_shard(rank)
        shutdown_rpc(failed=failed, timeout=timeout)

    return (lambda: client.push_pull([0.1])), teardown, store.port


def _worker(rank: int, world: int, case: str, sizes: Sequence[int], steps: int, bar: Any, pids: Any) -> dict[str, Any]:
    pids[rank] = os.getpid()
    # rpc.init_rpc's internal all_gather_object warns about a deprecated group type, not ours to fix
    warnings.filterwarnings("ignore", message="You are using a Backend")
    step, teardown, rpc_port = _setup(case, rank, world, sizes)
    failed = True
    try:
        step()  # warm-up: gloo pairs and TensorPipe pipes open lazily, on first use
        bar.wait(_WAIT_S)
        before = read_sockets() if rank == 0 else {}
        bar.wait(_WAIT_S)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = time.perf_counter() - start
        bar.wait(_WAIT_S)  # every rank's steps are done: every byte of them has arrived
        after = read_sockets() if rank == 0 else {}
        bar.wait(_WAIT_S)
        failed = False
        return {
            "before": before,
            "after": after,
            "seconds": seconds / steps,
            "master_port": os.environ["MASTER_PORT"],
            "rpc_port": rpc_port,
        }
    finally:
        teardown(failed)


def measure(case: str, world: int, sizes: Sequence[int], steps: int) -> Traffic:
    ctx = mp.get_context("fork")
    bar, pids = ctx.Barrier(world), ctx.Array("i", world)
    results = run_workers(_worker, world, case, list(sizes), steps, bar, pids, timeout=600.0)
    r0 = results[0]
    stores = {r0["master_port"]} | ({str(r0["rpc_port"])} if r0["rpc_port"] is not None else set())
    return traffic(r0["before"], r0["after"], [pids[r] for r in range(world)], stores, steps)


# --------------------------------------------------------------------------------------------
# Formulas and report
# --------------------------------------------------------------------------------------------


def formula_sent(case: str, world: int, sizes: Sequence[int]) -> list[float]:
    """Payload bytes each rank must send per step (no framing)."""
    n = sum(sizes)
    if case in ("ddp", "ring", "ring_bf16"):
        itemsize = 2 if case == "ring_bf16" else 4
        return [2 * (world - 1) / world * n * itemsize] * world
    if case == "ps_1":
        return [4.0 * (world - 1) * n] + [4.0 * n] * (world - 1)
    plan = shard_parameters(list(sizes), world)
    own = [sum(sizes[i] for i in idx) for idx in plan]
    return [4.0 * (n - own[r]) + 4.0 * (world - 1) * own[r] for r in range(world)]


def tensors_sent(case: str, world: int, sizes: Sequence[int]) -> list[int]:
    """Tensors each rank sends per step over RPC (pushes to remote shards, replies to remote workers)."""
    plan = shard_parameters(list(sizes), 1 if case == "ps_1" else world)
    held = [len(plan[r]) if r < len(plan) else 0 for r in range(world)]
    return [len(sizes) - (held[r] if r < len(plan) else 0) + (world - 1) * held[r] for r in range(world)]


def report(case: str, world: int, sizes: Sequence[int], got: Traffic) -> tuple[float, float]:
    """Print the lines of one run; return the bytes sent per step, measured and by formula, that the
    figure shows: the mean over workers, or for ``ps_1`` the server's (rank 0)."""
    want = formula_sent(case, world, sizes)
    tag = f"{case}_P{world}"
    mean_got, mean_want = sum(got.sent) / world, sum(want) / world
    ratio = sum(got.sent) / sum(want)
    line(f"wire_bytes_sent_per_step_{tag}", mean_got, "bytes")
    line(f"wire_bytes_sent_per_step_max_{tag}", max(got.sent), "bytes")
    line(f"formula_bytes_sent_per_step_{tag}", mean_want, "bytes")
    line(f"wire_over_formula_{tag}", ratio, "x")
    line(f"wire_over_formula_max_{tag}", max(g / w for g, w in zip(got.sent, want, strict=True)), "x")
    line(f"wire_overhead_{tag}", 100 * (ratio - 1), "%")
    line(f"wire_overhead_bytes_per_step_{tag}", mean_got - mean_want, "bytes")
    if case.startswith("ps"):  # TensorPipe frames every tensor: the overhead per tensor explains it
        line(
            f"wire_overhead_per_tensor_{tag}",
            (mean_got - mean_want) / (sum(tensors_sent(case, world, sizes)) / world),
            "bytes",
        )
    if case == "ps_1":
        line(f"wire_bytes_received_per_step_{tag}_server", got.received[0], "bytes")
        line(f"formula_bytes_received_per_step_{tag}_server", 4.0 * (world - 1) * sum(sizes), "bytes")
    line(f"store_bytes_per_step_{tag}", got.store, "bytes")
    line(f"retrans_bytes_per_step_{tag}", got.retrans, "bytes")
    print(
        f"# {tag}: {got.connections} worker-to-worker sockets; sent per rank {[round(s) for s in got.sent]}", flush=True
    )
    return (got.sent[0], want[0]) if case == "ps_1" else (mean_got, mean_want)


def plot(series: dict[str, dict[int, tuple[float, float]]], n: int, path: Path) -> None:
    """Measured bytes per worker (markers) beside the formulas (lines), against P."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    styles = {"ddp": ("o", "C2"), "ring": ("^", "C0"), "ring_bf16": ("v", "C9"), "ps": ("s", "C1"), "ps_1": ("D", "C3")}
    labels = {"ps_1": "ps, 1 server: the server", "ps": "ps, P shards"}
    for i, (case, points) in enumerate(series.items()):
        worlds = sorted(points)
        marker, color = styles[case]
        ax.plot(worlds, [points[p][1] / 1e6 for p in worlds], "--", color=color, linewidth=1)
        ax.plot(
            [p + 0.04 * (i - 2) for p in worlds],  # side by side: ddp, ring and ps share one formula
            [points[p][0] / 1e6 for p in worlds],
            marker,
            color=color,
            label=labels.get(case, case),
            fillstyle="none",
        )
    ax.set_xticks(sorted({p for pts in series.values() for p in pts}))
    ax.set_xlabel("workers P")
    ax.set_ylabel("MB sent per step and worker\n(mean over workers; 1 server: rank 0)", fontsize=9)
    ax.set_title(
        f"bytes on the wire (kernel counters), N = {n / 1e6:.1f}M\nmarkers measured, dashed the formula", fontsize=9
    )
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="N ~ 0.2M floats, P = 2 (CI)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after 1 warm-up)")
    parser.add_argument("--cases", nargs="+", choices=(*CASES, "ps_shm"), default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(header("wire_bytes: kernel TCP counters per step vs formulas (CPU, gloo + TensorPipe uv)"), flush=True)
    print(load_line("start"), flush=True)
    sizes = [max(1, s // (128 if args.quick else 4)) for s in resnet50_sizes()]
    n = sum(sizes)
    line("params_N", n, "floats")
    worlds = (2,) if args.quick else (2, 3)
    cases = args.cases or [*CASES, "ps_shm"]
    series: dict[str, dict[int, tuple[float, float]]] = {}
    off: list[str] = []
    for world in worlds:
        for case in cases:
            got = measure(case, world, sizes, args.steps)
            if case == "ps_shm":  # TensorPipe's own choice on one host: almost nothing on a socket
                line(f"ps_shm_bytes_sent_per_step_P{world}", sum(got.sent) / world, "bytes")
                continue
            series.setdefault(case, {})[world] = report(case, world, sizes, got)
            ratio = sum(got.sent) / sum(formula_sent(case, world, sizes))
            if not GOAL[0] <= ratio <= GOAL[1]:
                off.append(f"{case}_P{world}")
    print(load_line("end"), flush=True)
    print(f"# goal: every wire_over_formula in [{GOAL[0]}, {GOAL[1]}]; off: {', '.join(off) or 'none'}", flush=True)
    if not args.quick:
        plot(series, n, Path(__file__).parent / "results" / "wire_bytes.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
