"""Traffic of the sharded parameter server, and its step time against DDP.

Part 1, bytes: P fork-started CPU processes (gloo process group + TensorPipe RPC on
127.0.0.1, one torch thread each) push gradients of a synthetic parameter set with
ResNet-50's 161 tensor shapes (N = 25.6M float32) to ``num_servers`` shards (the partition of Part 0) and pull the
values, for P = 2, 3, 4 and num_servers = 1 and P. The busiest shard's payload bytes per step
(what it received plus what it sent, as the shards count them) give:

    server_bytes_over_formula_P{P}_S{S}  busiest shard / (2 x P x N x 4 / S)        goal 1.00 +- 0.02
    server_over_ring_bytes_P{P}_S{S}     busiest shard / busiest ring rank (measured)  theory P^2/(2(P-1)) at S=1
    server_over_ring_theory_P{P}_S{S}    P^2/(2(P-1)) x S_balance (the formula value for comparison)

where ring per-worker bytes = sent + received = 2 x 2(P-1)/P x N x 4 (reduce-scatter plus
all-gather, each direction), counted like the shard's received + sent. The ring is measured
too: the package's ``ring_all_reduce`` on the same N floats in the same P processes, its
busiest rank's sent + received bytes as its ``CommStats`` count them:

    ring_bytes_per_step_P{P}             busiest ring rank's sent + received bytes
    ring_bytes_over_formula_P{P}         that / (2 x 2(P-1)/P x N x 4)                goal 1.00 +- 0.001

With one server it carries P x N x 4 each way, P^2/(2(P-1)) times a ring worker; with P servers
each carries 1/P of that.

Part 0, balance (arithmetic, no processes): the busiest shard's bytes over the mean shard's
for ResNet-50's 161 tensors at S = 8, 64, 256 servers. A shard's bytes per step are
2 x P x (its elements) x 4, so the ratio is that of the elements held:

    ps_busiest_over_mean_bytes_resnet50_S{S}        the partition ps uses (flattened, balanced
                                                    chunks; a tensor may span servers)  goal <= 1.05
    ps_busiest_over_mean_bytes_resnet50_whole_S{S}  whole tensors per server (the plan kept for
                                                    LAMB / LARS), for comparison
    ps_empty_servers_resnet50_whole_S{S}            servers holding no tensor in that plan

Part 2, time: ``ps_over_ddp_step`` = median step time of ``strategy="ps"`` (pushes overlapped with
backward, pulls with the next forward: the default) / ``strategy="ddp"`` for a small MLP fitted by
Lightning on 2 fork-started CPU processes (goal <= 1.0), ``ps_no_overlap_over_ddp_step`` the same for
``overlap=False`` (push after the whole backward, wait for every shard), ``ps_bucket_replies_over_ddp_step``
for ``reply_per_bucket=True`` (each bucket split over the shards and answered alone; off by default on one
node), ``ps_ring_over_ddp_step`` for ``strategy="ps_ring"`` (the shards on the ring's reduce-scatter and
all-gather, no RPC) and ``ps_bucket_replies_over_ps_step`` that over ps's, the five in interleaved rounds, with
the raw medians; ``ps_overlap_share`` is the share of ps's push bytes sent before backward ended (the client's own
count, rank 0, median over rounds). A shared machine is noisy: read the ratio of interleaved runs, not the
milliseconds. ``{ps,ps_bucket_replies,ps_no_overlap,ps_ring,ddp}_cpu_ms_per_step``: the median CPU seconds per step of
rank 0's process, every thread (``time.process_time``): on 2 shared cores CPU per step bounds the step.

Part 3, the floor (#28): the CPU per step of the transport alone, without Lightning, a model or the
overlap: ``ParameterServerClient.push_pull`` of the step-time MLP's N floats (SGD with momentum on the
shards) against DDP's arithmetic on the same N (flatten, ``dist.all_reduce`` on gloo, copy back, SGD with
momentum on every tensor), per process, 2 processes, interleaved rounds:

    floor_ps_push_pull_cpu_ms_P2         ps's push/pull, CPU ms per step and process (median over rounds)
    floor_allreduce_cpu_ms_P2            all-reduce + local SGD, the same
    floor_ps_over_allreduce_cpu_P2       the ratio: what ps's transport costs over DDP's before any glue

    python benchmarks/ps_traffic.py           # N = 25.6M, P = 2, 3, 4 (~1-2 min on 2 cores)
    python benchmarks/ps_traffic.py --quick   # N ~ 0.2M, P = 2, 3 rounds (seconds, for CI)
    python benchmarks/ps_traffic.py --balance-only   # the partition's balance only (results/ps_partition.txt)
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, pyplot, save_figure
from benchmarks._workers import run_workers
from lightning_strategies.comm.ps import (
    OptimizerSpec,
    ParameterServerClient,
    ParameterShard,
    local_shard,
    partition_loads,
    partition_parameters,
    register_shard,
    shard_loads,
    shard_parameters,
    slice_of,
    unregister_shard,
)
from lightning_strategies.comm.ring import ring_all_reduce
from lightning_strategies.comm.rpc import init_rpc, rendezvous_store, shutdown_rpc


def resnet50_sizes() -> list[int]:
    """Element counts of ResNet-50's trainable tensors (25,557,032 in all), without weights."""
    try:
        import torchvision

        with torch.device("meta"):
            model = torchvision.models.resnet50()
        return [p.numel() for p in model.parameters()]
    except Exception:  # torchvision missing or broken: the same shapes by hand (stem, fc, blocks)
        sizes = [64 * 3 * 49, 64, 64, 2048 * 1000, 1000]
        for width, blocks, inp in ((64, 3, 64), (128, 4, 256), (256, 6, 512), (512, 3, 1024)):
            for b in range(blocks):
                cin = inp if b == 0 else 4 * width
                sizes += [width * cin, width, width, width * width * 9, width, width]
                sizes += [4 * width * width, 4 * width, 4 * width]
                if b == 0:
                    sizes += [4 * width * cin, 4 * width, 4 * width]
        return sizes


# --------------------------------------------------------------------------------------------
# Part 0: balance of the partition (arithmetic)
# --------------------------------------------------------------------------------------------


def balance(sizes: Sequence[int], servers: Sequence[int] = (8, 64, 256)) -> None:
    """Busiest over mean shard for the flattened partition and the whole-tensor plan."""
    for num_servers in servers:
        mean = sum(sizes) / num_servers
        flat = partition_loads(partition_parameters(sizes, num_servers))
        whole = shard_loads(sizes, shard_parameters(sizes, num_servers))
        line(f"ps_busiest_over_mean_bytes_resnet50_S{num_servers}", max(flat) / mean, "x")
        line(f"ps_busiest_over_mean_bytes_resnet50_whole_S{num_servers}", max(whole) / mean, "x")
        line(f"ps_empty_servers_resnet50_whole_S{num_servers}", sum(1 for n in whole if n == 0), "servers")


# --------------------------------------------------------------------------------------------
# Part 1: bytes per step, counted by the shards
# --------------------------------------------------------------------------------------------


def _traffic_worker(rank: int, world: int, sizes: Sequence[int], num_servers: int, steps: int) -> Any:
    timeout = datetime.timedelta(seconds=120)
    # RPC meets in a store of its own: the process group's store holds MASTER_PORT
    init_rpc(rank, world, rendezvous_store(rank, world, "127.0.0.1", timeout=timeout), timeout=timeout, num_threads=2)
    failed = True
    try:
        params = [torch.zeros(n, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.full_like(p, 1e-3 * (rank + 1))
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1))
        plan = partition_parameters(list(sizes), num_servers)  # what ps uses for SGD
        if rank < num_servers:
            mine = plan[rank]
            values = [slice_of(params[sl.tensor], sl) for sl in mine]
            shard = ParameterShard(rank, mine, values, spec, world, timeout=timeout)
            register_shard(shard)
        dist.barrier()
        client = ParameterServerClient(rank, params, plan, timeout=timeout)
        per_step: list[int] = []
        for _ in range(steps):
            client.push_pull([0.1])
            per_step.append(max(client.last_server_bytes))
        dist.barrier()  # every shard has answered every worker: its counts are final
        own = local_shard(rank)
        shard_stats = own.stats if own is not None else None
        failed = False
        return {"busiest_per_step": per_step, "shard": shard_stats, "client": client.stats}
    finally:
        unregister_shard(rank)
        shutdown_rpc(failed=failed, timeout=timeout)


def _ring_worker(rank: int, world: int, n: int) -> int:
    """Sent + received bytes of one ``ring_all_reduce`` of ``n`` float32 on this rank."""
    stats = ring_all_reduce(torch.ones(n), check_peers=False)
    return stats.bytes_sent + stats.bytes_received


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world, *args)`` in ``world`` forked processes with a gloo group; results by rank."""
    return run_workers(fn, world, *args, timeout=timeout)


def traffic(sizes: Sequence[int], worlds: Sequence[int], steps: int) -> dict[str, list[float]]:
    """Busiest-node bytes per step for ps (1 server, P servers) and ring, measured and by formula."""
    n = sum(sizes)
    line("params_N", n, "floats")
    series: dict[str, list[float]] = {"P": [], "ps_1": [], "ps_P": [], "ring": []}
    for world in worlds:
        series["P"].append(world)
        ring_bytes = max(run_world(_ring_worker, world, n))
        ring_formula = 2 * (2 * (world - 1) / world) * n * 4  # sent + received per worker
        line(f"ring_bytes_per_step_P{world}", ring_bytes, "bytes")
        line(f"ring_bytes_over_formula_P{world}", ring_bytes / ring_formula, "x")
        series["ring"].append(ring_bytes)
        for num_servers in sorted({1, world}):
            results = run_world(_traffic_worker, world, list(sizes), num_servers, steps)
            busiest = max(max(r["busiest_per_step"]) for r in results)
            # cross-check: the shards' own totals over all steps, busiest one per step
            shard_totals = [r["shard"].bytes_received + r["shard"].bytes_sent for r in results if r["shard"]]
            assert max(shard_totals) == busiest * steps, (shard_totals, busiest, steps)
            formula = 2 * world * n * 4 / num_servers
            tag = f"P{world}_S{num_servers}"
            line(f"server_bytes_per_step_{tag}", busiest, "bytes")
            line(f"server_bytes_over_formula_{tag}", busiest / formula, "x")
            line(f"server_over_ring_bytes_{tag}", busiest / ring_bytes, "x")
            line(f"server_over_ring_theory_{tag}", world**2 / (2 * (world - 1)) / num_servers, "x")
            series["ps_1" if num_servers == 1 else "ps_P"].append(busiest)
    return series


def plot_traffic(series: dict[str, list[float]], n: int, path: Path) -> None:
    """The seed's claim 1: a parameter server's traffic grows with workers, a ring's does not."""
    plt = pyplot()

    worlds = series["P"]
    mb = 1e6
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    ax.plot(worlds, [b / mb for b in series["ps_1"]], "o", color="C3", label="ps, 1 server (measured)")
    ax.plot(worlds, [2 * p * n * 4 / mb for p in worlds], "--", color="C3", label="2 P N x 4 B")
    ax.plot(worlds, [b / mb for b in series["ps_P"]], "s", color="C1", label="ps, P servers (measured)")
    ax.plot(worlds, [2 * n * 4 / mb for _ in worlds], "--", color="C1", label="2 N x 4 B")
    ax.plot(worlds, [b / mb for b in series["ring"]], "^", color="C0", label="ring, busiest worker (measured)")
    ax.plot(worlds, [2 * 2 * (p - 1) / p * n * 4 / mb for p in worlds], "--", color="C0", label="2 x 2(P-1)/P N x 4 B")
    ax.set_xticks(worlds)
    ax.set_xlabel("workers P")
    ax.set_ylabel("MB per step at the busiest node")
    ax.set_title(f"traffic per step, N = {n / 1e6:.1f}M floats")
    ax.legend(fontsize=7)
    save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# Part 2: step time of ps against ddp under Lightning
# --------------------------------------------------------------------------------------------


def _timed_fit(strategy_name: str, steps: int, width: int, rpc_threads: int) -> tuple[float, float, float]:
    """Median step seconds of one Lightning fit on 2 fork-started CPU processes (rank 0's), for ps with
    overlap the mean share of push bytes sent before backward ended (else nan), and the median CPU
    seconds per step of rank 0's process."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
    from lightning_strategies.strategies.ps_ring import RingParameterServerStrategy

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.stamps.append(time.perf_counter())
            self.cpu.append(time.process_time())  # every thread of the process

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            gaps = [b - a for a, b in zip(self.stamps[5:], self.stamps[6:], strict=False)]  # 5 warm-up steps
            # callback_metrics travel back to the parent process with the fork launcher
            trainer.callback_metrics["bench/step_s"] = torch.tensor(median(gaps))
            cpu = [b - a for a, b in zip(self.cpu[5:], self.cpu[6:], strict=False)]
            trainer.callback_metrics["bench/cpu_s"] = torch.tensor(median(cpu))
            overlap = getattr(trainer.strategy, "overlap", None)
            shares = [t.overlap_share for t in overlap.push.timeline] if overlap is not None else []
            trainer.callback_metrics["bench/share"] = torch.tensor(sum(shares) / len(shares) if shares else math.nan)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64 * 32, 256, generator=g), torch.randint(0, 10, (64 * 32,), generator=g))
    strategy: Any = (
        DDPStrategy(start_method="fork")
        if strategy_name == "ddp"
        else RingParameterServerStrategy(start_method="fork")
        if strategy_name == "ps_ring"
        else ParameterServerStrategy(
            start_method="fork",
            rpc_threads=rpc_threads,
            overlap=strategy_name != "ps_no_overlap",
            reply_per_bucket=True if strategy_name == "ps_bucket_replies" else None,
        )
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer()],
    )
    trainer.fit(Mlp(), DataLoader(data, batch_size=32))
    metrics = trainer.callback_metrics
    return float(metrics["bench/step_s"]), float(metrics["bench/share"]), float(metrics["bench/cpu_s"])


def step_time(rounds: int, steps: int, width: int, rpc_threads: int = 4) -> None:
    # keep stdout to `name value unit` lines: Lightning's per-fit banners go to its logger
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    params = 256 * width + width + width * width + width + width * 10 + 10
    line("mlp_params", params, "floats")
    names = ("ps", "ps_bucket_replies", "ps_no_overlap", "ps_ring", "ddp")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    shares: list[float] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # none always runs first
        for name in order:
            seconds, share, cpu = _timed_fit(name, steps, width, rpc_threads)
            times[name].append(seconds)
            cpus[name].append(cpu)
            if name == "ps":
                shares.append(share)
    for name in names:
        line(f"{name}_step_ms", median(times[name]) * 1e3, "ms")
    for name in names:
        line(f"{name}_cpu_ms_per_step", median(cpus[name]) * 1e3, "ms")
    for name in names[:-1]:
        ratios = [p / d for p, d in zip(times[name], times["ddp"], strict=True)]
        line(f"{name}_over_ddp_step", median(ratios), "x")
    bucket_replies = [b / p for b, p in zip(times["ps_bucket_replies"], times["ps"], strict=True)]
    line("ps_bucket_replies_over_ps_step", median(bucket_replies), "x")
    line("ps_overlap_share", median(shares), "x")


# --------------------------------------------------------------------------------------------
# Part 3: the floor, the transport's CPU per step without Lightning
# --------------------------------------------------------------------------------------------


def _floor_tensors(rank: int, sizes: Sequence[int]) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [torch.zeros(n, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3 * (rank + 1))
    return params, torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _cpu_per_step(step: Callable[[], None], steps: int) -> float:
    for _ in range(5):  # warm-up: connections, allocator
        step()
    dist.barrier()
    start = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - start) / steps


def _floor_ps_worker(rank: int, world: int, sizes: Sequence[int], steps: int, rpc_threads: int) -> float:
    """CPU seconds per ``push_pull`` of this process (every thread: its shard's RPC handlers too)."""
    timeout = datetime.timedelta(seconds=120)
    store = rendezvous_store(rank, world, "127.0.0.1", timeout=timeout)
    init_rpc(rank, world, store, timeout=timeout, num_threads=rpc_threads)
    failed = True
    try:
        params, optimizer = _floor_tensors(rank, sizes)
        plan = partition_parameters(list(sizes), world)
        mine = plan[rank]
        spec = OptimizerSpec.from_optimizer(optimizer)
        register_shard(ParameterShard(rank, mine, [slice_of(params[sl.tensor], sl) for sl in mine], spec, world))
        dist.barrier()
        client = ParameterServerClient(rank, params, plan, timeout=timeout)
        seconds = _cpu_per_step(lambda: client.push_pull([0.1]), steps)
        dist.barrier()  # every shard has answered
        failed = False
        return seconds
    finally:
        unregister_shard(rank)
        shutdown_rpc(failed=failed, timeout=timeout)


def _floor_allreduce_worker(rank: int, world: int, sizes: Sequence[int], steps: int, rpc_threads: int) -> float:
    """CPU seconds per step of DDP's arithmetic: one flat bucket all-reduced on gloo, then local SGD."""
    params, optimizer = _floor_tensors(rank, sizes)
    grads = [p.grad for p in params if p.grad is not None]

    def step() -> None:
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()

    return _cpu_per_step(step, steps)


def floor(rounds: int, steps: int, width: int, rpc_threads: int = 4) -> None:
    """ps's push/pull against all-reduce + SGD, CPU per step and process, for the step-time MLP's tensors."""
    sizes = [256 * width, width, width * width, width, width * 10, 10]
    runs: dict[str, list[float]] = {"ps": [], "allreduce": []}
    for r in range(rounds):
        for name in ("ps", "allreduce") if r % 2 == 0 else ("allreduce", "ps"):
            fn = _floor_ps_worker if name == "ps" else _floor_allreduce_worker
            runs[name].append(median(run_world(fn, 2, sizes, steps, rpc_threads)))
    line("floor_ps_push_pull_cpu_ms_P2", median(runs["ps"]) * 1e3, "ms")
    line("floor_allreduce_cpu_ms_P2", median(runs["allreduce"]) * 1e3, "ms")
    line(
        "floor_ps_over_allreduce_cpu_P2",
        median([p / a for p, a in zip(runs["ps"], runs["allreduce"], strict=True)]),
        "x",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small N, P=2, few rounds (CI)")
    parser.add_argument("--steps", type=int, default=2, help="push/pull steps per traffic run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved ps/ddp rounds (default 7; quick 3)")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the step-time MLP")
    parser.add_argument("--rpc-threads", type=int, default=4, help="ParameterServerStrategy(rpc_threads=...)")
    parser.add_argument(
        "--balance-only", action="store_true", help="only the partition's balance at 8, 64, 256 servers (arithmetic)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(header("ps_traffic"), flush=True)
    print(load_line("start"), flush=True)
    sizes = resnet50_sizes()
    balance(sizes)  # full-size shapes even in quick mode: arithmetic only
    if args.balance_only:
        return 0
    if args.quick:
        sizes = [max(1, s // 128) for s in sizes]
    series = traffic(sizes, (2,) if args.quick else (2, 3, 4), args.steps)
    if not args.quick:
        plot_traffic(series, sum(sizes), Path(__file__).parent / "results" / "ps_traffic.png")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    step_time(rounds, steps=20 if args.quick else 60, width=args.width, rpc_threads=args.rpc_threads)
    floor(rounds, steps=20 if args.quick else 200, width=args.width, rpc_threads=args.rpc_threads)
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
