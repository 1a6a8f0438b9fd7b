"""The floor of a parameter server on the ring's two halves (issue #28's untried path), against ddp's exchange.

``ps`` keeps shard s (1/P of the flat parameters) on rank s and moves pushes and pulls over TensorPipe RPC,
whose transport alone costs more than gloo's all-reduce here (``ps_traffic.py``'s
``floor_ps_over_allreduce_cpu_P2``). The shards sit where a ring reduce-scatter leaves each rank's chunk, so
a synchronous ps could push with comm.ring's reduce-scatter (each rank ends with the averaged gradient of its
own chunk), step its shard's optimizer on that 1/P, and pull with comm.ring's all-gather of the new values.
This measures that exchange and update, without a model and without Lightning, beside ddp's: gloo's
``all_reduce`` of the gradient, then the optimizer step on all of it.

P fork-started CPU processes (gloo, one torch thread each). Each repetition runs the four methods
interleaved, in a rotating order, each after a barrier and timed as the slowest rank's wall time; a ratio is
the median over repetitions of the ratio within one repetition. Methods, on N float32 parameters:

    gloo           ``dist.all_reduce`` of the gradient (ddp's exchange)
    halves         comm.ring's reduce-scatter (averaging) of the gradient, then its all-gather of the parameters
    ddp_step       gloo + SGD (momentum 0.9) on all N
    ps_ring_step   halves around SGD on this rank's chunk only (N/P): the ps of this path

Lines (``P<p>_N<n>``):

    ps_ring_exchange_over_allreduce_   halves / gloo: the transport, the same bytes each way
    ps_ring_step_over_ddp_             ps_ring_step / ddp_step: transport and update
    ps_ring_params_max_abs_diff_vs_ddp after the last repetition (every method's update applied to its own
                                       copy from the same start), the largest |ps_ring - ddp| of a parameter;
                                       summation order only (a float32 rounding of the average per step)
    <method>_ms_                       medians

Context, measured elsewhere: ``ps_over_ddp_step`` (``ps_traffic.py``, the 0.4M-parameter MLP of the loopback
fits) and ``ring_over_gloo_P2_N25.6M`` (``allreduce.py``).

    python benchmarks/ps_ring_floor.py            # P = 2, 4; N = 0.4M (the fits' MLP), 25.6M (ResNet-50)
    python benchmarks/ps_ring_floor.py --quick    # P = 2, N = 64K, 3 repetitions (CI)
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
from lightning_strategies.comm.ring import owned_chunk, ring_all_gather, ring_reduce_scatter

METHODS = ("gloo", "halves", "ddp_step", "ps_ring_step")
LR, MOMENTUM = 0.05, 0.9


class _Replica:
    """One method's parameters, gradient and SGD state (a flat buffer; the ps path's optimizer sees only this
    rank's chunk, a view of the buffer)."""

    def __init__(self, start: torch.Tensor, chunk: tuple[int, int] | None) -> None:
        self.flat = start.clone()
        self.grad = torch.empty_like(start)
        a, b = chunk if chunk is not None else (0, start.numel())
        self.param = torch.nn.Parameter(self.flat[a:b])  # shares the buffer: a step writes into ``flat``
        self.chunk = (a, b)
        self.opt = torch.optim.SGD([self.param], lr=LR, momentum=MOMENTUM)

    def step(self) -> None:
        a, b = self.chunk
        self.param.grad = self.grad[a:b]
        self.opt.step()


def _halves(grad: torch.Tensor, params: torch.Tensor, between: Callable[[], None] | None = None) -> None:
    """comm.ring's reduce-scatter of ``grad`` (averaging; each rank ends owning chunk (rank + 1) % P), then
    ``between`` (the shard's step), then the all-gather of ``params``' owned chunks."""
    pg = dist.group.WORLD
    assert pg is not None
    ring_reduce_scatter(grad, pg, average=True)
    if between is not None:
        between()
    ring_all_gather(params, pg)


def _measure(n: int, reps: int, warmup: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    start = torch.randn(n, generator=torch.Generator().manual_seed(0))  # the same parameters on every rank
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own gradients
    ddp, ps = _Replica(start, None), _Replica(start, owned_chunk(n, world, rank))
    scratch = _Replica(start, None)  # the exchange-only methods' buffers (their results are not kept)

    def ddp_step() -> None:
        dist.all_reduce(ddp.grad)
        ddp.grad.div_(world)
        ddp.step()

    runs: dict[str, Callable[[], object]] = {
        "gloo": lambda: dist.all_reduce(scratch.grad),
        "halves": lambda: _halves(scratch.grad, scratch.flat),
        "ddp_step": ddp_step,
        "ps_ring_step": lambda: _halves(ps.grad, ps.flat, ps.step),
    }
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(warmup + reps):
        g = torch.randn(n, generator=gen)
        for name in METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]:
            for replica in (ddp, ps, scratch):
                replica.grad.copy_(g)
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if rep >= warmup:
                times[name].append(float(elapsed))
    diff = torch.tensor([float((ps.flat - ddp.flat).abs().max())], dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    ratio = {
        "exchange": median([h / g for h, g in zip(times["halves"], times["gloo"], strict=True)]),
        "step": median([p / d for p, d in zip(times["ps_ring_step"], times["ddp_step"], strict=True)]),
    }
    return {"ms": {m: 1e3 * median(v) for m, v in times.items()}, "ratio": ratio, "diff": float(diff)}


def _worker(rank: int, world: int, sizes: Sequence[int], reps: int, warmup: int) -> dict[int, Any]:
    torch.set_num_threads(1)
    return {n: _measure(n, reps, warmup) for n in sizes}


def main(argv: Sequence[str] | None = None) -> int:
    parser = world_size_parser(
        __doc__, quick="P = 2, N = 64K, 3 repetitions (CI smoke run)", procs=[2, 4], sizes=[0.4e6, 25.6e6],
        reps=15, timeout=900.0, n="parameters",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.procs, args.sizes, args.reps, args.warmup = [2], [65536], 3, 1
    sizes = [int(s) for s in args.sizes]
    print(header("ps on the ring's halves (co-located shards) vs ddp's exchange (CPU, gloo, 1 thread)"), flush=True)
    print(load_line("start"), flush=True)
    for world in args.procs:
        got = run_workers(_worker, world, sizes, args.reps, args.warmup, timeout=args.timeout, pg_timeout_s=300)[0]
        for n in sizes:
            tag, r = f"P{world}_N{size_label(n)}", got[n]
            line(f"ps_ring_exchange_over_allreduce_{tag}", r["ratio"]["exchange"], "x")
            line(f"ps_ring_step_over_ddp_{tag}", r["ratio"]["step"], "x")
            line(f"ps_ring_params_max_abs_diff_vs_ddp_{tag}", r["diff"], "abs")
            for m, ms in r["ms"].items():
                line(f"{m}_ms_{tag}", ms, "ms")
        print(f"# P={world} done, {load_line('now').removeprefix('# ')}", flush=True)
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
