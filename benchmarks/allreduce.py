"""Our ring all-reduce against gloo's ``dist.all_reduce`` and a naive parameter-server reduce.

P fork-started CPU processes on one machine, joined by a gloo process group on 127.0.0.1,
one torch thread each. In every repetition the methods run *interleaved* in the same
processes (gloo, ring, ring with a bfloat16 wire, reduce-to-one-then-broadcast, and the
three diagnostics below), each after a barrier, timed as the slowest rank's wall time, in
an order that rotates every repetition; a ratio is the median over repetitions of
(method / gloo in the same repetition). Prints a header (machine, versions, date), then
``name value unit`` lines per P and N:

    ring_over_gloo_P{P}_N{N}        ring time / gloo all_reduce time    goal <= 1.05 at 25.6M, P=2,3
    ring_bf16_over_gloo_P{P}_N{N}   bf16-wire ring / gloo all_reduce     goal <= 0.7
    ps_over_gloo_P{P}_N{N}          reduce-to-rank-0 + broadcast / gloo  (the contrast)
    bytes_over_formula_P{P}_N{N}    ring bytes_sent / (2(P-1)/P x N x 4)  goal 1.000 (<= 1.001)

and the raw medians (``gloo_ms_P{P}_N{N}``, ...). Loopback TCP on a shared machine is noisy:
read the ratios, which are measured side by side, rather than the milliseconds. The ring
runs with ``check_peers=False``, as the ``"ring"`` strategy's DDP hook calls it (the check
is one small all-gather, ~0.3 ms here).

Where the bf16 wire's time goes, measured in the same repetitions:

    xfer_over_gloo_P{P}_N{N}        the ring's float32 messages alone (same segments, no arithmetic)
    xfer_bf16_over_gloo_P{P}_N{N}   its bfloat16 messages alone
    bf16_casts_over_gloo_P{P}_N{N}  the bf16 ring's dtype conversions alone (no messages)

so ``xfer - xfer_bf16`` is the most a 2-byte wire can save here, and ``bf16_casts`` what it
costs back: ``ring_bf16 ~ ring - (xfer - xfer_bf16) + bf16_casts``. On loopback the wire is
itself a pair of memory copies (sender into the socket, socket into the receiver), so halving
the bytes saves about as much memory traffic as converting them costs; across machines the
saving is the network time of half the bytes.

On one machine every byte costs the same two memory copies whichever rank sends it, so the
naive reduce moves as many bytes in total as the ring (2(P-1) x N) and is not slower here;
the ring's advantage is per-link bandwidth, which appears across machines (or NICs).

The hierarchical ring, at P = 4 seen as 2 nodes x 2 processes (a ``NodeLayout`` over the same
processes: ranks 0-1 and 2-3; the bytes are the algorithms' own accounting, the same on any
machine, the times only what loopback says):

    hier_inter_node_bytes_over_flat     the busiest process's bytes sent to the other node, hierarchical
                                        / flat ring (the flat ring's node-crossing links carry
                                        2(P-1)/P x N x 4 each, the hierarchical ring's
                                        2(N-1)/N x N/L x 4): 1/3 at 2 x 2        goal <= 0.55
    hier_inter_node_bytes_over_formula  that hierarchical count / (2(N-1)/N x N/L x 4)  goal 1.000
    hier_node_egress_over_flat          bytes leaving a node, all its processes summed, hierarchical
                                        / flat: 2/3 at 2 x 2 (a flat ring in node order already
                                        sends one stream out of each node; the hierarchical one
                                        splits it over L links and 2(N-1) instead of 2(NL-1) steps)
    ring_hier_over_gloo_P4_N{N}         its time / gloo's (loopback: every link is the same memory copy)

    python benchmarks/allreduce.py            # P = 2, 3, 4; N = 1M, 25.6M float32 (~2-3 min)
    python benchmarks/allreduce.py --quick    # P = 2 and 4, N = 64K, 3 repetitions (seconds, for CI)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, size_label, world_size_parser
from benchmarks._workers import run_workers
from lightning_strategies.comm import ring_all_reduce
from lightning_strategies.comm.ring import NodeLayout, hierarchical_all_reduce, new_hierarchical_groups
from lightning_strategies.comm.ring.transport import _SEGMENT_BYTES, _WINDOW, _WIRE_SEGMENT_BYTES

METHODS = ("gloo", "ring", "ring_bf16", "ps", "xfer", "xfer_bf16", "bf16_casts")
HIER_NODES, HIER_LOCAL = 2, 2  # the hierarchical ring runs where P = 4, as 2 nodes x 2


def _ps_all_reduce(t: torch.Tensor, scratch: list[torch.Tensor]) -> None:
    """Naive parameter server: everyone sends to rank 0, rank 0 sums and sends the sum back.

    Rank 0 receives and sends (P-1) x N elements while the others idle: its link is the
    bottleneck the ring removes.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        works = [dist.irecv(scratch[src - 1], src) for src in range(1, world)]
        for src, w in enumerate(works, start=1):
            assert w is not None
            w.wait()
            t.add_(scratch[src - 1])
        for w in [dist.isend(t, dst) for dst in range(1, world)]:
            assert w is not None
            w.wait()
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def _transfer(buf: torch.Tensor, slots: list[torch.Tensor], seg: int, steps: int) -> None:
    """The ring's messages without its arithmetic: ``steps`` times ``buf``, in segments, to the
    successor, while the predecessor's land in ``slots``; receives posted ``_WINDOW`` ahead, on
    the same process-group calls the ring makes.
    """
    pg, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    assert pg is not None
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    bounds = [(a, min(a + seg, buf.numel())) for a in range(0, buf.numel(), seg)]
    units = [(a, b) for _ in range(steps) for a, b in bounds]

    def post(u: int) -> Any:
        a, b = units[u]
        return pg.recv([slots[u % len(slots)][: b - a]], prev, u)

    posted = [post(u) for u in range(min(_WINDOW, len(units)))]
    sends = []
    for u, (a, b) in enumerate(units):
        sends.append(pg.send([buf[a:b]], nxt, u))
        posted[u].wait()
        if u + _WINDOW < len(units):
            posted.append(post(u + _WINDOW))
    for w in sends:
        w.wait()


def _bf16_casts(y: torch.Tensor, world: int, shadow: torch.Tensor, slot: torch.Tensor, up: torch.Tensor) -> None:
    """The dtype conversions one rank of the bf16-wire ring makes, without its messages or adds.

    Per chunk of N/P elements: its own chunk down-cast once; each of the P-1 reduce-scatter steps
    a received segment up-cast and the partial sum rounded back down; the owned chunk's final
    value up-cast into the tensor; each of the P-1 all-gather steps a segment up-cast into the
    tensor. The tensor ranges are the ones the ring touches (cold memory, like the ring's).
    """
    rank, seg, chunk = dist.get_rank(), slot.numel(), y.numel() // world

    def ranges(c: int) -> list[tuple[int, int]]:
        start = (c % world) * chunk
        return [(a, min(a + seg, start + chunk)) for a in range(start, start + chunk, seg)]

    for a, b in ranges(rank):
        shadow[a:b].copy_(y[a:b])
    for t in range(world - 1):
        for a, b in ranges(rank - t - 1):
            part = up[: b - a]
            part.copy_(slot[: b - a])
            shadow[a:b].copy_(part)
    for a, b in ranges(rank + 1):
        y[a:b].copy_(shadow[a:b])
    for t in range(world - 1):
        for a, b in ranges(rank - t):
            y[a:b].copy_(slot[: b - a])


def _measure(n: int, reps: int, warmup: int, hier: tuple[NodeLayout, Any, Any] | None) -> dict[str, Any]:
    """Median wall time of each method on N float32 elements, interleaved, on this rank.

    With ``hier`` (layout, intra-node group, inter-node group) the hierarchical ring runs too and
    the flat ring splits its bytes by node on the same layout.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    y = torch.empty_like(x)
    scratch = [torch.empty_like(x) for _ in range(world - 1)] if rank == 0 else []
    bytes_sent: list[int] = []
    chunk = -(-n // world)
    fp32_seg, wire_seg = _SEGMENT_BYTES // 4, _WIRE_SEGMENT_BYTES // 2
    fp32_buf, wire_buf = torch.randn(chunk), torch.randn(chunk).bfloat16()
    fp32_slots = list(torch.empty((_WINDOW + 1) * fp32_seg).split(fp32_seg))
    wire_slots = list(torch.empty((_WINDOW + 1) * wire_seg, dtype=torch.bfloat16).split(wire_seg))
    shadow, up = torch.empty(n, dtype=torch.bfloat16), torch.empty(wire_seg)

    inter: dict[str, list[int]] = {"ring": [], "ring_hier": []}

    def ring() -> None:
        stats = ring_all_reduce(y, check_peers=False, layout=hier[0] if hier else None)
        bytes_sent.append(stats.bytes_sent)
        if stats.inter_node_bytes_sent is not None:
            inter["ring"].append(stats.inter_node_bytes_sent)

    def ring_hier() -> None:
        assert hier is not None
        stats = hierarchical_all_reduce(y, hier[1], hier[2], check_peers=False)
        assert stats.inter_node_bytes_sent is not None
        inter["ring_hier"].append(stats.inter_node_bytes_sent)

    def ring_bf16() -> None:
        ring_all_reduce(y, wire_dtype=torch.bfloat16, check_peers=False)

    runs: dict[str, Callable[[], Any]] = {
        "gloo": lambda: dist.all_reduce(y),
        "ring": ring,
        "ring_bf16": ring_bf16,
        "ps": lambda: _ps_all_reduce(y, scratch),
        "xfer": lambda: _transfer(fp32_buf, fp32_slots, fp32_seg, 2 * (world - 1)),
        "xfer_bf16": lambda: _transfer(wire_buf, wire_slots, wire_seg, 2 * (world - 1)),
        "bf16_casts": lambda: _bf16_casts(y, world, shadow, wire_slots[0], up),
        "ring_hier": ring_hier,
    }
    methods = (*METHODS, "ring_hier") if hier else METHODS
    times: dict[str, list[float]] = {m: [] for m in methods}
    for rep in range(warmup + reps):
        # Rotate the order so no method always runs right after the same other one.
        for name in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            y.copy_(x)
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            # The collective is as slow as its slowest rank.
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= warmup:
                times[name].append(float(elapsed))
    sent = torch.tensor([max(bytes_sent)], dtype=torch.int64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    # Ratios per repetition (the methods ran seconds apart), then the median: load that drifts
    # over the run cancels out better than in a ratio of medians.
    ratios = {m: median([t / g for t, g in zip(times[m], times["gloo"], strict=True)]) for m in methods}
    out = {"ms": {m: 1000 * median(v) for m, v in times.items()}, "ratio": ratios, "bytes_sent": int(sent)}
    if hier:
        # this process's node-crossing bytes per call (the same every call); the busiest process,
        # and every node's total (its processes summed: what leaves the node)
        mine = torch.tensor([max(inter["ring"]), max(inter["ring_hier"])], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        flat_per_rank, hier_per_rank = zip(*(r.tolist() for r in rows), strict=True)
        per_node = [[sum(v[r] for r in ranks) for ranks in hier[0].nodes] for v in (flat_per_rank, hier_per_rank)]
        out["inter"] = {"flat_max": max(flat_per_rank), "hier_max": max(hier_per_rank),
                        "flat_node_max": max(per_node[0]), "hier_node_max": max(per_node[1])}  # fmt: skip
    return out


def _bench_worker(rank: int, world: int, sizes: Sequence[int], reps: int, warmup: int) -> Any:
    hier = None
    if world == HIER_NODES * HIER_LOCAL:
        layout = NodeLayout.contiguous(HIER_NODES, HIER_LOCAL)
        hier = (layout, *new_hierarchical_groups(layout, backend="gloo"))
    return {n: _measure(n, reps, warmup, hier) for n in sizes}


def run_world(world: int, sizes: Sequence[int], reps: int, warmup: int, timeout: float) -> dict[int, Any]:
    """Run the measurements in ``world`` forked processes, return rank 0's results."""
    return dict(run_workers(_bench_worker, world, sizes, reps, warmup, timeout=timeout, pg_timeout_s=120)[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = world_size_parser(
        __doc__, quick="P=2 and 4, N=64K, 3 repetitions (CI smoke run)", procs=[2, 3, 4], sizes=[1e6, 25.6e6],
        reps=15, timeout=600.0, n="elements",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.procs, args.sizes, args.reps, args.warmup = [2, 4], [65536], 3, 1
    sizes = [int(s) for s in args.sizes]
    print(header("ring all-reduce vs gloo all_reduce vs naive PS (CPU, gloo, 1 thread/process)"), flush=True)
    print(load_line("start"), flush=True)
    for world in args.procs:
        results = run_world(world, sizes, args.reps, args.warmup, args.timeout)
        for n in sizes:
            tag = f"P{world}_N{size_label(n)}"
            ms, ratio = results[n]["ms"], results[n]["ratio"]
            formula = 2 * (world - 1) / world * n * 4
            line(f"ring_over_gloo_{tag}", ratio["ring"], "x")
            line(f"ring_bf16_over_gloo_{tag}", ratio["ring_bf16"], "x")
            line(f"ps_over_gloo_{tag}", ratio["ps"], "x")
            line(f"xfer_over_gloo_{tag}", ratio["xfer"], "x")
            line(f"xfer_bf16_over_gloo_{tag}", ratio["xfer_bf16"], "x")
            line(f"bf16_casts_over_gloo_{tag}", ratio["bf16_casts"], "x")
            line(f"bytes_over_formula_{tag}", results[n]["bytes_sent"] / formula, "x")
            if "ring_hier" in ratio:
                line(f"ring_hier_over_gloo_{tag}", ratio["ring_hier"], "x")
            for m in ms:
                line(f"{m}_ms_{tag}", ms[m], "ms")
        if world == HIER_NODES * HIER_LOCAL:
            n = max(sizes)  # byte counts, not times: the same at every N up to uneven chunking
            inter = results[n]["inter"]
            formula = 2 * (HIER_NODES - 1) / HIER_NODES * n / HIER_LOCAL * 4
            line("hier_inter_node_bytes_over_flat", inter["hier_max"] / inter["flat_max"], "x")
            line("hier_inter_node_bytes_over_formula", inter["hier_max"] / formula, "x")
            line("hier_node_egress_over_flat", inter["hier_node_max"] / inter["flat_node_max"], "x")
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
