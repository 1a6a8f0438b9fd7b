"""The measurements of ``benchmarks/scale.py``, run in P fork-started gloo processes (or under torchrun).

One call of :func:`world_worker` is one world of one *kind*: ``"coll"`` (ddp, ring, ring_hier,
pipeline: a process group only, as those strategies run) or ``"rpc"`` (ps, ps_1, async: the
process group and TensorPipe RPC, as those strategies run). The kinds are separate worlds because
an RPC agent is not idle when idle: its shared-memory reactor thread (``TP_SHM_reactor``) polls,
20-55% of a core per process measured on this 2-vCPU machine, which the collectives and the
pipeline never pay. A world sets up its groups (and RPC, and the pipeline), then runs ``reps``
repetitions; each repetition runs, in a rotated order, the calibration (:func:`calibrate`: the
micro-benchmarks the model's constants come from, none of them a strategy's step) and one timed
run of every strategy of its kind (:func:`run_strategy`). Rank 0 returns a list of repetitions,
each a dict of calibration figures and strategy step times (seconds), bytes and load averages.

The strategies are the comm layer of the package, driven directly with a compute stand-in:

    ddp        compute; ``dist.all_reduce`` of each DDP bucket (1 MiB, then 25 MiB) of N float32
    ring       compute; ``comm.ring.ring_all_reduce`` of each bucket (the "ring" strategy's hook)
    ring_hier  the same with ``hierarchical=True`` (torchrun, 2 nodes x 2 only; when comm.ring has it)
    ps         compute; ``ParameterServerClient.push_pull`` to P shards (``partition_parameters``, SGD)
    ps_1       the same with one shard on rank 0
    async      a batch from the worker's ``BatchLease`` (refilled from the ``AsyncCoordinator`` on
               rank 0 in the background), compute, ``push(pull=True)`` to P ``AsyncParameterShard`` s;
               per worker, timed over a window (no lockstep)
    pipeline   ``PipelineRuntime`` of K = P stages of Linear + tanh blocks, GPipe, M micro-batches

The compute stand-in is a fixed number of 256 x 256 matmuls + tanh: real CPU work, so P processes
on 2 cores contend for them as training processes would, and fixed work, not a fixed time.
"""

from __future__ import annotations

import datetime
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor

from benchmarks._pipeline_models import loss as pipeline_loss
from benchmarks._pipeline_models import real_balanced
from benchmarks._scale_costs import CALIB_BIG, CALIB_SMALL
from lightning_strategies.advisor.model import ddp_buckets
from lightning_strategies.comm.async_ import (
    AsyncCoordinator,
    BatchLease,
    DataPlan,
    register_coordinator,
    unregister_coordinator,
)
from lightning_strategies.comm.async_ps import AsyncParameterServerClient, AsyncParameterShard
from lightning_strategies.comm.pipeline import PipelineRuntime
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    partition_parameters,
    register_shard,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.ring import (
    NodeLayout,
    hierarchical_all_reduce,
    new_hierarchical_groups,
    ring_all_reduce,
)
from lightning_strategies.comm.rpc import init_rpc, shutdown_rpc, worker_name

__all__ = ["SYNC", "compute_standin", "standin_iters", "world_worker"]

SYNC = ("ddp", "ring", "ring_hier", "ps", "ps_1", "pipeline")
_TIMEOUT = datetime.timedelta(seconds=180)
_LR = [0.01]
_keys = itertools.count()  # store keys of this process's calibration rounds (every rank counts alike)


def compute_standin(iters: int, x: Tensor, w: Tensor) -> Tensor:
    """``iters`` matmuls of 256 x 256 with a tanh: the step's forward + backward, as CPU work."""
    for _ in range(iters):
        x = torch.tanh(x @ w)
    return x


def _standin_tensors() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g) / 16


def standin_iters(target_s: float) -> int:
    """Iterations of the stand-in that take ``target_s`` in this (lone) process, median of 5."""
    x, w = _standin_tensors()
    compute_standin(20, x, w)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        compute_standin(50, x, w)
        times.append((time.perf_counter() - t0) / 50)
    return max(1, round(target_s / statistics.median(times)))


# --------------------------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------------------------


def _max_over_ranks(value: float, group: dist.ProcessGroup | None = None) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _timed(step: Callable[[], Any], steps: int, warmup: int = 1) -> float:
    """Seconds per step of ``step`` run in lockstep by every rank: the slowest rank's time."""
    for _ in range(warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return _max_over_ranks((time.perf_counter() - t0) / steps)


def _together(fn: Callable[[], Any], reps: int) -> float:
    """Median over ``reps`` of the slowest rank's seconds of ``fn``, every rank running it at once."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(_max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times)


def _alone(fn: Callable[[], Any], reps: int, ranks: Sequence[int] = (0,)) -> float:
    """Median seconds of ``fn`` on ``ranks`` while the other ranks wait in a barrier (idle)."""
    times: list[float] = []
    for _ in range(reps):
        dist.barrier()
        if dist.get_rank() in ranks:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        dist.barrier()
    return _max_over_ranks(statistics.median(times) if times else 0.0)


# --------------------------------------------------------------------------------------------
# The world's state
# --------------------------------------------------------------------------------------------


def _world_group() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None
    return world


def _group(ranks: list[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` (every rank calls it); on a rank outside ``ranks`` the world group,
    never used there."""
    group = dist.new_group(ranks)
    return group if isinstance(group, dist.ProcessGroup) else _world_group()


class World:
    """What every repetition reuses: tensors, groups, the stand-in, the pipeline's blocks."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        self.rpc = bool(cfg.get("rpc"))
        self.sizes: list[int] = list(cfg["sizes"])
        self.n = sum(self.sizes)
        self.flat = torch.full((self.n,), 1e-3 * (rank + 1))
        bucket_elems = [int(b) // 4 for b in ddp_buckets(4 * self.n)]
        self.buckets = list(self.flat.split(bucket_elems))
        self.params = [torch.zeros(s, requires_grad=True) for s in self.sizes]
        grad_flat = torch.full((self.n,), 1e-3 * (rank + 1))
        for p, g in zip(self.params, grad_flat.split(self.sizes), strict=True):
            p.grad = g.view_as(p)
        self.spec = OptimizerSpec.from_optimizer(torch.optim.SGD(self.params, lr=_LR[0]))
        # as many tensors, of 16 elements: what ps costs per tensor and per message, without bytes
        self.tiny_params = [torch.zeros(16, requires_grad=True) for _ in self.sizes]
        for p in self.tiny_params:
            p.grad = torch.full_like(p, 1e-3)
        self.x, self.w = _standin_tensors()
        self.iters = int(cfg["iters"])
        # ranks 0 and 1 alone: the calibration's tiny instances of each protocol
        self.pair = _group([0, 1])
        # simulated nodes (torchrun): the node layout; flat ring calls count their inter-node bytes
        local = int(cfg.get("local_size") or world)
        self.layout = NodeLayout.contiguous(world // local, local) if local < world else None
        self.hier_groups = new_hierarchical_groups(self.layout, backend="gloo") if self.layout else None
        self.pipe = None if self.rpc else cfg.get("pipeline")
        if self.pipe is not None:
            dim, per_stage = self.pipe["dim"], self.pipe["blocks_per_stage"]
            self.blocks = real_balanced(dim, per_stage * world)
            self.stage_blocks = real_balanced(dim, per_stage)
            m, mb = self.pipe["microbatches"], self.pipe["rows"]
            g = torch.Generator().manual_seed(1)
            self.px, self.py = torch.randn(m * mb, dim, generator=g), torch.randn(m * mb, dim, generator=g)
            self.runtime = PipelineRuntime(
                self.blocks, counts=[per_stage] * world, schedule="gpipe", microbatches=m, loss_fn=pipeline_loss,
                group=_world_group(), device=torch.device("cpu"),
            )  # fmt: skip
            # a 2-stage pipeline of the pair with blocks 8 wide: what the runtime and its transfers
            # cost per chunk, without compute
            self.tiny_runtime: PipelineRuntime | None = None
            self.tx, self.ty = torch.randn(m * mb, 8, generator=g), torch.randn(m * mb, 8, generator=g)
            if rank < 2:
                self.tiny_runtime = PipelineRuntime(
                    real_balanced(8, 2 * per_stage), counts=[per_stage] * 2, schedule="gpipe", microbatches=m,
                    loss_fn=pipeline_loss, group=self.pair, device=torch.device("cpu"),
                )  # fmt: skip

    def compute(self) -> None:
        compute_standin(self.iters, self.x, self.w)


# --------------------------------------------------------------------------------------------
# Calibration: the model's constants
# --------------------------------------------------------------------------------------------


def _exchange(w: World, nbytes: int, reps: int) -> float:
    """Ranks 0 and 1 send each other ``nbytes`` at once, as a ring step does (both directions)."""
    pg = dist.group.WORLD
    assert pg is not None
    out, into = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    peer = 1 - w.rank

    def swap() -> None:
        got = pg.recv([into], peer, 7)
        sent = pg.send([out], peer, 7)
        got.wait()
        sent.wait()

    def many() -> None:
        for _ in range(4):
            swap()

    if w.rank in (0, 1):
        swap()  # the pair's connection exists before the timing
    return _alone(many, reps, ranks=(0, 1)) / 4


def _echo(t: Tensor) -> Tensor:
    return t


def _rpc_round_trip(w: World, nbytes: int, reps: int) -> float:
    """Rank 1 calls rank 0 over RPC with ``nbytes`` of payload that comes back (a push and a reply)."""
    payload = torch.ones(max(1, nbytes // 4))

    def call() -> None:
        for _ in range(4):
            rpc.rpc_sync("ps_worker0", _echo, args=(payload,))

    if w.rank == 1:
        call()
    return _alone(call, reps, ranks=(1,)) / 4


def _ps_host(w: World, params: Sequence[Tensor], reps: int, tag: str) -> dict[str, float]:
    """ps's host work in rank 0 alone with a local shard (no RPC), over ``params``: the shard's update
    (SGD + reply packing) for one worker, for two (and their averaging), and a whole local
    ``push_pull`` (the client's packing and copying back on top). Seconds, medians."""
    sizes = [p.numel() for p in params]
    plan = partition_parameters(sizes, 1)
    values = [slice_of(params[sl.tensor], sl) for sl in plan[0]]
    grads = [p.grad for p in params]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=_LR[0]))
    out = {f"ps_update{tag}_s": 0.0, f"ps_two{tag}_s": 0.0, f"ps_local{tag}_s": 0.0}
    if w.rank == 0:
        one = ParameterShard(0, plan[0], values, spec, 1, timeout=_TIMEOUT)
        two = ParameterShard(0, plan[0], values, spec, 2, timeout=_TIMEOUT)
        register_shard(one)
        client = ParameterServerClient(0, params, plan, timeout=_TIMEOUT)

        def push_one() -> None:
            one.push(0, one.version, grads, _LR).wait()

        def push_two() -> None:
            two.push(0, two.version, grads, _LR)
            two.push(1, two.version, grads, _LR).wait()

        def push_pull() -> None:
            client.step = one.version
            client.push_pull(_LR)

        for name, f in (("update", push_one), ("two", push_two), ("local", push_pull)):
            f()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            out[f"ps_{name}{tag}_s"] = statistics.median(times)
        unregister_shard(0)
        two.close()
    dist.barrier()
    return out


def _ps_pair(w: World, params: Sequence[Tensor], num_servers: int, reps: int) -> float:
    """A ``push_pull`` of ranks 0 and 1 alone (the others idle) to ``num_servers`` shards on them."""
    sizes = [p.numel() for p in params]
    plan = partition_parameters(sizes, num_servers, align=1)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=_LR[0]))
    shard = None
    if w.rank < num_servers:
        values = [slice_of(params[sl.tensor], sl) for sl in plan[w.rank]]
        shard = ParameterShard(w.rank, plan[w.rank], values, spec, 2, timeout=_TIMEOUT)
        register_shard(shard)
    dist.barrier()
    client = ParameterServerClient(w.rank, params, plan, timeout=_TIMEOUT) if w.rank < 2 else None

    def push_pull() -> None:
        assert client is not None
        client.push_pull(_LR)

    if client is not None:
        push_pull()
    seconds = _alone(push_pull, reps, ranks=(0, 1))
    if shard is not None:
        unregister_shard(w.rank)
        shard.close()
    return seconds


def _wake(w: World, busy: int, trials: int, nbytes: int) -> float:
    """Mean latency of a pipeline hop while ``busy`` processes other than the receiver compute.

    A hop as ``torch.distributed.pipelining`` makes it: the sender posts an ``isend`` of
    ``nbytes`` (a micro-batch's activation) and, from ``busy = 1`` on, goes straight on computing
    (a stage's next chunk; ranks 2 .. spin the stand-in for ``busy > 1``) before it waits for the
    send; the receiver posts its ``recv`` before the send in half the trials and 1.5 ms after it
    in the other half (a stage still busy with its previous chunk). The latency is from the later
    of the two posts to the receive's end: gloo moves a message whose receive is posted late only
    when the sender's side runs, which on a busy machine waits for a core. The mean, not the
    median: a pipeline's step is a sum of such waits, and their tail is most of it.
    """
    spinners = min(max(busy - 1, 0), w.world - 2)
    key = f"wake{next(_keys)}"
    store = dist.distributed_c10d._get_default_store()
    msg = torch.zeros(max(1, nbytes // 8), dtype=torch.float64)  # the sender's clock in msg[0]
    ack = torch.zeros(1)
    lat: list[float] = []
    dist.barrier()
    if 2 <= w.rank < 2 + spinners:
        while not store.check([key]):
            compute_standin(2, w.x, w.w)
    elif w.rank == 0:
        for _ in range(trials):
            time.sleep(1e-3)  # an early receiver is asleep in recv by now
            msg[0] = time.perf_counter()
            sent = dist.isend(msg, 1, group=w.pair)
            assert sent is not None  # this rank is in the pair
            if busy >= 1:
                compute_standin(4, w.x, w.w)
            sent.wait()
            dist.recv(ack, 1, group=w.pair)
        store.set(key, "1")
    elif w.rank == 1:
        for i in range(trials):
            if i % 2:
                time.sleep(1.5e-3)
            posted = time.perf_counter()
            dist.recv(msg, 0, group=w.pair)
            lat.append(time.perf_counter() - max(posted, float(msg[0])))
            dist.send(ack, 0, group=w.pair)
    dist.barrier()
    return _max_over_ranks(statistics.fmean(lat) if lat else 0.0)


def _stage_forward_backward(w: World, reps: int) -> tuple[float, float]:
    """Seconds of one stage's forward and of its backward on one micro-batch, rank 0 alone."""
    assert w.pipe is not None
    sample = w.px[: w.pipe["rows"]]
    fwd: list[float] = []
    bwd: list[float] = []

    def once() -> None:
        x = sample.detach().requires_grad_(True)
        t0 = time.perf_counter()
        out = w.stage_blocks(x)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)

    if w.rank == 0:
        once()  # allocators warm
        fwd.clear()
        bwd.clear()
    _alone(once, reps)
    for p in w.stage_blocks.parameters():
        p.grad = None
    return (
        _max_over_ranks(statistics.median(fwd) if fwd else 0.0),
        _max_over_ranks(statistics.median(bwd) if bwd else 0.0),
    )


def _rpc_exchange(w: World, nbytes: int, reps: int, ranks: Sequence[int] | None = None) -> float:
    """Every rank of ``ranks`` (default all) echoes ``nbytes`` off every other one of them at once
    and waits for all replies: the transport of a ps step (a push of D/P to every peer, a reply
    of as much from each), with its message sizes, its peers and its RPC threads, without the
    protocol (no barrier, no packing, no optimizer). Median seconds of the slowest rank."""
    members = list(range(w.world)) if ranks is None else list(ranks)
    payload = torch.ones(max(1, nbytes // 4))

    def call() -> None:
        futures = [rpc.rpc_async(worker_name(r), _echo, args=(payload,)) for r in members if r != w.rank]
        for f in futures:
            f.wait()

    if w.rank in members:
        call()  # the pipes exist and the sizes were seen before the timing
    return _alone(call, reps, ranks=members)


def _rpc_gather(w: World, nbytes: int, reps: int) -> float:
    """Ranks 1 .. P-1 echo ``nbytes`` off rank 0 at once: one server's transport (ps_1), P-1
    pushes of D in and P-1 replies of D out through one process."""
    payload = torch.ones(max(1, nbytes // 4))
    workers = range(1, w.world)

    def call() -> None:
        rpc.rpc_sync(worker_name(0), _echo, args=(payload,))

    if w.rank in workers:
        call()
    return _alone(call, reps, ranks=workers)


def calibrate(w: World) -> dict[str, float]:
    """The constants of this repetition, by the world's kind: compute alone and all at once (both
    kinds); the gloo links, the ring's and the pipeline's own costs, the pipeline's hops
    (``coll``); RPC's transport at the runs' sizes and ps's host work (``rpc``)."""
    reps = w.cfg["calib_reps"]
    out: dict[str, float] = {}
    out["compute_s"] = _alone(w.compute, reps)
    out["compute_all_s"] = _together(w.compute, reps)
    a, b = torch.ones(CALIB_BIG // 4), torch.ones(CALIB_BIG // 4)
    out["add_big_s"] = _alone(lambda: a.add_(b), reps)
    if w.rpc:
        out.update(_calibrate_rpc(w, reps))
    else:
        out.update(_calibrate_coll(w, reps))
    # every rank returns the same figures (rank 0's were broadcast by the max-reductions above)
    return {k: _max_over_ranks(v) for k, v in sorted(out.items())}


def _calibrate_coll(w: World, reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["exchange_small_s"] = _exchange(w, CALIB_SMALL, reps)
    out["exchange_big_s"] = _exchange(w, CALIB_BIG, reps)
    tiny = torch.zeros(1)

    def tiny_allreduce() -> None:
        for _ in range(4):
            dist.all_reduce(tiny, group=w.pair)

    out["gloo_tiny_allreduce_s"] = _alone(tiny_allreduce, reps, ranks=(0, 1)) / 4
    small_ring = torch.zeros(1024)

    def tiny_ring() -> None:
        for _ in range(4):
            ring_all_reduce(small_ring, w.pair, check_peers=False)

    if w.rank < 2:
        tiny_ring()  # the pair's connections exist before the timing
    out["ring_tiny_s"] = _alone(tiny_ring, reps, ranks=(0, 1)) / 4
    if w.pipe is not None:
        activation = 4 * w.pipe["rows"] * w.pipe["dim"]
        for busy in range(w.world):
            out[f"wake_{busy}_s"] = _wake(w, busy, w.cfg["wake_trials"], activation)
        out["stage_forward_s"], out["stage_backward_s"] = _stage_forward_backward(w, reps)

        def tiny_pipeline() -> None:
            assert w.tiny_runtime is not None
            w.tiny_runtime.step(w.tx, w.ty)
            for p in w.tiny_runtime.stage_parameters:
                p.grad = None

        if w.rank < 2:
            tiny_pipeline()  # shapes inferred, buffers allocated
        cpu: list[float] = []

        def tiny_pipeline_cpu() -> None:
            # the main thread's CPU seconds: the runtime's work per step, whatever it waited for
            t0 = time.thread_time()
            tiny_pipeline()
            cpu.append(time.thread_time() - t0)

        out["pipeline_tiny_s"] = _alone(tiny_pipeline_cpu, reps, ranks=(0, 1))
        # the pair's mean (each stage runs 2M chunks)
        mine = statistics.median(cpu) if cpu else 0.0
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total)
        out["pipeline_tiny_cpu_s"] = float(total) / 2
    return out


def _calibrate_rpc(w: World, reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["rpc_small_s"] = _rpc_round_trip(w, CALIB_SMALL, reps)
    out["rpc_big_s"] = _rpc_round_trip(w, CALIB_BIG, reps)
    grad_bytes = 4 * w.n
    # the transports of the runs, at their sizes: ps and async (D/P to every peer), ps_1 (D to rank 0)
    out["rpc_exchange_s"] = _rpc_exchange(w, grad_bytes // w.world, reps)
    out["rpc_gather_s"] = _rpc_gather(w, grad_bytes, reps)
    # the tiny ps push_pull's transport (the pair, 16 elements per tensor), to take out of it
    out["rpc_exchange_tiny_s"] = _rpc_exchange(w, 4 * 16 * len(w.sizes) // 2, reps, ranks=(0, 1))
    out.update(_ps_host(w, w.params, reps, ""))
    out.update(_ps_host(w, w.tiny_params, reps, "_tiny"))
    # the ps protocol's own cost per message: RPC, the barrier, the threads' hand-offs (tiny tensors)
    out["ps_pair_tiny_s"] = _ps_pair(w, w.tiny_params, 2, reps)
    return out


# --------------------------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------------------------


def _bucket_step(w: World, reduce: Callable[[Tensor], Any]) -> tuple[Callable[[], None], Callable[[], dict]]:
    """DDP's step shape: compute, then every bucket reduced in order; bytes from the reducer's CommStats."""
    stats: list[tuple[int, int]] = []

    def step() -> None:
        w.compute()
        sent = across = 0
        for b in w.buckets:
            got = reduce(b)
            if got is not None:
                sent, across = sent + got.bytes_sent, across + (got.inter_node_bytes_sent or 0)
        stats.append((sent, across))

    def finish() -> dict[str, float]:
        out = {"sent_bytes": _max_over_ranks(float(max(s for s, _ in stats)))}
        if w.layout is not None:
            out["inter_sent_bytes"] = _max_over_ranks(float(max(a for _, a in stats)))
        return out if any(s for s, _ in stats) else {}

    return step, finish


def _ps_setup(w: World, num_servers: int) -> tuple[Callable[[], None], Callable[[], dict]]:
    """ps's step with S = ``num_servers`` shards on ranks 0 .. S-1; ``finish`` reports the bytes this rank
    sent to other ranks per step (the busiest rank's) and takes the shards down."""
    plan = partition_parameters(w.sizes, num_servers)
    shard = None
    if w.rank < num_servers:
        values = [slice_of(w.params[sl.tensor], sl) for sl in plan[w.rank]]
        shard = ParameterShard(w.rank, plan[w.rank], values, w.spec, w.world, timeout=_TIMEOUT)
        register_shard(shard)
    dist.barrier()  # every shard is up before the first push
    client = ParameterServerClient(w.rank, w.params, plan, timeout=_TIMEOUT)
    start = [0, 0]

    def counted() -> int:
        return client.stats.bytes_sent + (shard.stats.bytes_sent if shard else 0)

    def step() -> None:
        if start[1] == 0:
            start[0] = counted()
        w.compute()
        client.push_pull(_LR)
        start[1] += 1

    def finish() -> dict[str, float]:
        dist.barrier()  # every reply is in before a shard goes
        own = 4 * sum(sl.numel for sl in plan[w.rank]) if shard else 0
        # the co-located shard's push and reply are counted but never leave the process
        sent = (counted() - start[0]) / start[1] - 2 * own
        unregister_shard(w.rank)
        if shard is not None:
            shard.close()
        return {"sent_bytes": _max_over_ranks(sent)}

    return step, finish


def _async_windows(w: World, window_s: float, windows: int, probe: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """Seconds per worker step of async (mean over workers) in each of ``windows`` windows, each
    right after a probe of the machine, and the bytes a worker sends per step.

    As the ``async`` strategy of main runs it: batches from a local :class:`BatchLease` (refilled
    from the coordinator on rank 0 in the background, off the step's critical path), compute, a
    push with pull to every shard, the push noted in the lease (its acks ride on the next refill).
    Workers are not in lockstep, so a window, not a step, is the unit of timing.
    """
    plan = partition_parameters(w.sizes, w.world)
    values = [slice_of(w.params[sl.tensor], sl) for sl in plan[w.rank]]
    shard = AsyncParameterShard(w.rank, plan[w.rank], values, w.spec, w.world, timeout=_TIMEOUT)
    register_shard(shard)
    coordinator = None
    if w.rank == 0:
        coordinator = AsyncCoordinator(w.world, None, timeout=_TIMEOUT)
        register_coordinator(coordinator)
    dist.barrier()
    client = AsyncParameterServerClient(w.rank, w.params, plan, timeout=_TIMEOUT)
    lease = BatchLease(w.rank, coordinator_rank=0, rpc_timeout=_TIMEOUT.total_seconds() + 10)
    data = DataPlan(num_samples=100_000, batch_size=1, shuffle=False)  # more than the windows' batches
    grads = [p.grad for p in w.params]

    def step() -> None:
        batch = lease.next(0, data)
        assert batch is not None
        w.compute()
        client.push(grads, _LR, pull=True)
        lease.pushed(client.clock, [batch])

    step()
    own = 4 * sum(sl.numel for sl in plan[w.rank])
    out: dict[str, Any] = {}
    sent_total = steps_total = 0.0
    for _ in range(windows):
        dist.barrier()  # every push of the last window answered: the probe sees an idle world
        for k, v in probe().items():
            out.setdefault(k, []).append(v)
        before = client.stats.bytes_sent + shard.stats.bytes_sent
        done = 0
        t0 = time.perf_counter()
        while done == 0 or time.perf_counter() - t0 < window_s:
            step()
            done += 1
        elapsed = time.perf_counter() - t0
        dist.barrier()  # every push has been answered (and counted by its shard) before the counts are read
        sent = client.stats.bytes_sent + shard.stats.bytes_sent - before
        # a worker's push to its own shard and that shard's reply to it (own bytes each) never leave
        # the process; summed over workers, remote bytes / steps is exact whatever each worker's pace
        totals = torch.tensor([elapsed / done, sent - 2.0 * own * done, float(done)], dtype=torch.float64)
        dist.all_reduce(totals)
        out.setdefault("step_s", []).append(float(totals[0]) / w.world)
        sent_total, steps_total = sent_total + float(totals[1]), steps_total + float(totals[2])
    time.sleep(0.05)  # refills in flight are answered
    dist.barrier()
    if coordinator is not None:
        unregister_coordinator()
    unregister_shard(w.rank)
    shard.close()
    out["sent_bytes"] = sent_total / steps_total
    return out


def _setup(w: World, name: str) -> tuple[Callable[[], None], Callable[[], dict]]:
    """Strategy ``name``'s step (every rank calls it in lockstep) and what to do after the last one."""
    if name == "ddp":
        return _bucket_step(w, lambda b: dist.all_reduce(b))
    if name == "ring":
        return _bucket_step(w, lambda b: ring_all_reduce(b, check_peers=False, layout=w.layout))
    if name == "ring_hier":
        groups = w.hier_groups
        assert groups is not None, "ring_hier needs simulated nodes (cfg local_size)"
        return _bucket_step(w, lambda b: hierarchical_all_reduce(b, *groups, check_peers=False))
    if name in ("ps", "ps_1"):
        return _ps_setup(w, w.world if name == "ps" else 1)
    if name == "pipeline":

        def step() -> None:
            w.runtime.step(w.px, w.py)
            for p in w.runtime.stage_parameters:
                p.grad = None

        return step, dict
    raise ValueError(f"unknown strategy {name!r}")


def _probe(w: World, reps: int) -> dict[str, float]:
    """The machine at this moment: the stand-in on rank 0 alone and on every rank at once.

    (A 4 KiB exchange or RPC as a probe of message latency was tried: on a loaded machine its
    wake-up delays are heavy-tailed, and one probe that short misreads the next step by 10-100x.)
    """
    return {"probe_alone_s": _alone(w.compute, reps), "probe_all_s": _together(w.compute, reps)}


def run_strategy(w: World, name: str) -> dict[str, Any]:
    """Timed steps of strategy ``name``, each right after a probe of the machine (:func:`_probe`).

    The load of a shared machine changes within a second; a step and the probe just before it see
    about the same machine, so the model predicts each step from its own probe. Returns lists, one
    entry per step (``step_s`` and the probe's figures), and the bytes this rank sent per step.
    ``async`` runs over windows, each after its probe: its workers are not in lockstep. ``load``:
    the machine's 1-minute load average as the run starts (other jobs included).
    """
    load = {"load": _max_over_ranks(os.getloadavg()[0] if w.rank == 0 else 0.0)}
    if name == "async":
        windows = max(1, w.cfg["steps"] // 2)
        got = _async_windows(w, w.cfg["async_window_s"], windows, lambda: _probe(w, w.cfg["probe_reps"]))
        return {**got, **load}
    step, finish = _setup(w, name)
    step()  # warm-up: connections, buffers, the pipeline's shapes
    out: dict[str, Any] = dict(load)
    for _ in range(w.cfg["steps"]):
        for k, v in _probe(w, w.cfg["probe_reps"]).items():
            out.setdefault(k, []).append(v)
        out.setdefault("step_s", []).append(_timed(step, 1, warmup=0))
    out.update(finish())
    return out


# --------------------------------------------------------------------------------------------
# One world
# --------------------------------------------------------------------------------------------


def world_worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``cfg["reps"]`` repetitions of calibration + every strategy in ``cfg["strategies"]``.

    Returns, on every rank, the list of repetitions: ``calib/<name>`` and ``<strategy>/<key>``.
    """
    torch.set_num_threads(1)
    # rpc.init_rpc's internal all_gather_object warns about a deprecated group type, not ours to fix
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.filterwarnings("ignore", message=".*torch.distributed.pipelining.*")
    if cfg.get("rpc"):
        init_rpc(rank, world, f"tcp://127.0.0.1:{cfg['rpc_port']}", timeout=_TIMEOUT, num_threads=4)
    failed = True
    try:
        w = World(rank, world, cfg)
        items = ["calib", *cfg["strategies"]]
        out: list[dict[str, Any]] = []
        for rep in range(cfg["reps"]):
            shift = (rep + cfg.get("offset", 0)) % len(items)
            row: dict[str, Any] = {}
            for item in items[shift:] + items[:shift]:
                if item == "calib":
                    row.update({f"calib/{k}": v for k, v in calibrate(w).items()})
                else:
                    row.update({f"{item}/{k}": v for k, v in run_strategy(w, item).items()})
            out.append(row)
        failed = False
        return out
    finally:
        if cfg.get("rpc"):
            shutdown_rpc(failed=failed, timeout=_TIMEOUT)
