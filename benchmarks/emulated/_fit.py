"""What every torchrun worker of ``benchmarks/cluster_strategies.py`` runs: a short Lightning fit of an MLP.

    python -m benchmarks.emulated --nodes 2 --per-node 2 --rate 200mbit -- \\
        python benchmarks/emulated/_fit.py --strategy ring --steps 8 --warmup 3 --out /tmp/run

The model is an MLP (``--width`` wide, ``--layers`` hidden layers: 1.31 M parameters, D = 5.25 MB
of fp32 gradients at the defaults) on synthetic data that every rank draws alike (the benchmark
times steps, it does not train to an accuracy; the pipeline's stages and a tensor-parallel group
need the same batches anyway). Every rank writes ``<out>/rank<r>.json``: its step durations
(``on_train_batch_start`` to ``on_train_batch_end``) and, on each node's local rank 0, the node's
NIC counters at the start of step ``--warmup`` and at the end of the last step, so the bytes per
step exclude set-up (rendezvous, the first broadcast, RPC start); under ps, whose pull overlaps the next
forward, the values in flight land and the ranks meet before each reading, so no other step's replies are
counted. Each record also holds, over the timed steps, their wall and CPU seconds (``window``: the time
between steps included) and each thread's CPU seconds, and per step the forward's and backward's ends
(``phases``, with the main thread's CPU clock at each: ``cpu_start``, ``cpu_backward``, ``cpu_optimizer``)
and the overlapped push's timestamps (``push_timeline``): where a step's time goes. Global
rank 0 writes the step count to ``$EMULATED_CLUSTER_STEPS_FILE`` for the launcher.

``--link-sample-ms t`` (> 0) has each node's local rank 0 read its link's byte counters every ``t`` ms over
the timed steps (a thread; ``link_samples``: ``[perf_counter, tx_bytes, rx_bytes]`` rows) and its TCP
connections to other nodes at both ends (``link_tcp``): when the link carries bytes and when it stands idle
within a step, and what limited TCP (``cluster_strategies.py --link-sample-ms``, ``benchmarks/_link_timeline.py``).

``--backward-ms t`` has every linear layer's backward sleep its share of ``t`` ms (a heavier model's backward, with
no core taken from the other processes: what an overlapped push can hide behind).

``--slow-node-factor k`` (with ``--base-ms``) makes the last node's ranks ``k`` times slower, as
``benchmarks/stragglers.py`` does: every rank sleeps ``--base-ms`` before its optimizer step
(standing in for a heavier model), and the slowed ranks then sleep ``k - 1`` times their own
recent compute (batch start to optimizer step, median of the last 10).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PipelineStrategy,
    RingAllReduceStrategy,
    RingParameterServerStrategy,
    TensorParallelStrategy,
)
from lightning_strategies.strategies._lightning_internals import per_rank_sigterm

STRATEGIES = (
    "ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps_flat", "ps_one_shot", "ps_local_sigterm", "ps1", "async",
    "async_flat", "pipeline", "tensor", "ps_aligned", "ps_unaligned", "ps_one_reply",
    "ps_bucket_replies", "ps_bucket_plan", "ps1_one_reply", "ps_ring",
    "ps_ring_flat",
)  # fmt: skip
IN, OUT = 256, 16


class MLP(pl.LightningModule):
    """``IN -> width x layers -> OUT`` with ReLUs; the pipeline's two methods included. ``backward_ms`` > 0: each
    linear layer's backward sleeps its share of that many ms (standing in for a heavier model's backward, which
    an overlapped push or all-reduce can hide communication behind; a sleep takes no core from the others)."""

    def __init__(self, width: int, layers: int, backward_ms: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [IN, *[width] * layers, OUT]
        mods: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            mods += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*mods[:-1])
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        share = backward_ms / 1000 / len(linears)
        for m in linears if backward_ms > 0 else []:
            m.register_full_backward_pre_hook(lambda *_: time.sleep(share))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


class BucketPlanOneReply(ParameterServerStrategy):
    """ps with ``reply_per_bucket``'s plan (every bucket split over every shard) but one step and one reply per
    shard: which half of that option does what (not a mode users get)."""

    def _plan_replies(self, *args: Any, **kwargs: Any) -> Any:
        plan = super()._plan_replies(*args, **kwargs)
        self._replies_per_bucket = False  # the shards step once, and the values land per shard
        return plan


def make_strategy(name: str) -> Any:
    """The strategy the benchmark calls ``name`` (one of :data:`STRATEGIES`)."""
    if name == "ddp":
        return pl.strategies.DDPStrategy(process_group_backend="gloo")
    if name in ("ring", "ring_hier", "ring_bf16"):
        # "ring" alone goes hierarchical on more than one node: the flat ring is asked for by name
        return RingAllReduceStrategy(
            hierarchical=name == "ring_hier", wire_dtype="bf16" if name == "ring_bf16" else None
        )
    if name in ("ps", "ps_local_sigterm"):  # ps_local_sigterm: main() swaps Lightning's per-step broadcast out
        return ParameterServerStrategy()
    if name in ("ps_aligned", "ps_unaligned"):  # every step's pushes aligned (default: where flat across nodes)
        return ParameterServerStrategy(align_pushes=name == "ps_aligned")
    if name in ("ps_one_reply", "ps_bucket_replies"):  # one step and reply per shard, or per bucket (every
        return ParameterServerStrategy(reply_per_bucket=name == "ps_bucket_replies")  # bucket over every shard)
    if name == "ps_bucket_plan":
        return BucketPlanOneReply(reply_per_bucket=True)
    if name == "ps_flat":
        return ParameterServerStrategy(hierarchical=False)
    if name == "ps_one_shot":  # the push after the whole backward, the pull before the optimizer step returns
        return ParameterServerStrategy(overlap=False)
    if name in ("ps1", "ps1_one_reply"):  # one server; across nodes each bucket answered alone, or not
        return ParameterServerStrategy(num_servers=1, reply_per_bucket=False if name == "ps1_one_reply" else None)
    if name in ("ps_ring", "ps_ring_flat"):  # ps's co-located shards on the ring's halves (no RPC)
        return RingParameterServerStrategy(hierarchical=False if name == "ps_ring_flat" else None)
    if name == "async":  # the node is the worker on several nodes of more than one process
        return AsyncParameterServerStrategy()
    if name == "async_flat":
        return AsyncParameterServerStrategy(hierarchical=False)
    if name == "pipeline":
        return PipelineStrategy()
    if name == "tensor":
        return TensorParallelStrategy()
    raise ValueError(f"strategy {name!r}: expected one of {STRATEGIES}. Fix: pass --strategy with one of them")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads (name:tid), from /proc."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def link_statistics() -> Path:
    """The folder of this node's link counters in /sys (the link: GLOO_SOCKET_IFNAME, set by the launcher)."""
    return Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"


def nic_counters() -> dict[str, int]:
    """This node's link counters, read from /sys."""
    base = link_statistics()
    return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}


_TCP_FIELDS = ("bytes_sent", "bytes_received", "busy", "rwnd_limited", "sndbuf_limited")


def tcp_counters() -> dict[str, dict[str, float]]:
    """This node's TCP connections to other nodes (``ss -tinH``; loopback and the node's own address left out): per
    connection ``local>peer``, its cumulative bytes sent and received and ms busy sending, limited by the peer's
    receive window, and limited by its own send buffer (``tcp_info``; a field the kernel leaves out is 0)."""
    out: dict[str, dict[str, float]] = {}
    try:
        ss = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10)
        text = ss.stdout
    except (OSError, subprocess.SubprocessError):  # no ss (iproute2's): no TCP figures, the rest of the fit stands
        return out
    conn = None
    for raw in text.splitlines():
        if not raw[:1].isspace():  # "recv-q send-q local peer": a connection
            parts = raw.split()
            local, peer = parts[-2], parts[-1]
            same = local.rsplit(":", 1)[0] == peer.rsplit(":", 1)[0]  # a peer in this node (its own address)
            conn = None if same or peer.startswith(("127.", "[::1]", "[::ffff:127.")) else f"{local}>{peer}"
            continue
        if conn is None:
            continue
        info = dict(kv.split(":", 1) for kv in raw.split() if ":" in kv and not kv.startswith("("))
        out[conn] = {k: float(info.get(k, "0").split("ms")[0].split("(")[0]) for k in _TCP_FIELDS}
    return out


class LinkSampler:
    """This node's link counters every ``period_s`` seconds on a daemon thread, from :meth:`start` to :meth:`stop`:
    rows of ``[time.perf_counter(), tx_bytes, rx_bytes]`` (the clock the other timestamps use), and its TCP
    connections' counters at both ends (``tcp``: :func:`tcp_counters`)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.rows: list[list[float]] = []
        self.tcp: dict[str, dict[str, dict[str, float]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        base = link_statistics()
        tx, rx = base / "tx_bytes", base / "rx_bytes"
        self.tcp["start"] = tcp_counters()

        def run() -> None:
            while not self._stop.is_set():
                self.rows.append([time.perf_counter(), int(tx.read_text()), int(rx.read_text())])
                self._stop.wait(self.period_s)

        self._thread = threading.Thread(target=run, name="link-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.tcp["end"] = tcp_counters()


class Measure(pl.Callback):
    """Step durations; the node's NIC counters over steps ``warmup ..`` (local rank 0); a straggler."""

    def __init__(
        self, *, steps: int, warmup: int, base_ms: float, slow_factor: float, slowed: bool, link_sample_ms: float = 0.0
    ) -> None:
        self.steps, self.warmup = steps, warmup
        self.base_ms, self.slow_factor, self.slowed = base_ms, slow_factor, slowed
        self.start = 0.0
        self.durations: list[float] = []
        self.own: list[float] = []
        self.nic: dict[str, dict[str, int]] = {}
        self.local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.sampler = LinkSampler(link_sample_ms / 1000.0) if link_sample_ms > 0 and self.local0 else None
        #: per step, seconds from its start: forward's end (backward's start), backward's end
        self.phases: list[dict[str, float]] = []
        self.push_timeline: list[dict[str, Any]] = []
        #: over the timed steps: their wall seconds, gaps between steps included, and CPU seconds
        self.window: dict[str, float] = {}
        self.threads: dict[str, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self._quiesce(trainer)
            if self.sampler is not None:  # before the clocks: its first TCP reading runs ss (a process)
                self.sampler.start()
            self.window = {"wall": time.perf_counter(), "cpu": time.process_time()}  # every thread's CPU
            self.threads = thread_cpu()
            if self.local0:
                self.nic["start"] = nic_counters()
        self.start = time.perf_counter()
        self.phases.append({"t0": self.start})
        self._cpu_mark("start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
        self.phases[-1]["backward"] = time.perf_counter() - self.start
        self._cpu_mark("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.phases[-1]["optimizer"] = time.perf_counter() - self.start
        self._cpu_mark("optimizer")

    def _cpu_mark(self, at: str) -> None:
        """The main thread's CPU seconds (hooks run on it) at ``at``: per step, the training step's (forward, or
        a pipeline's whole schedule), the backward's, and the optimizer step's and the loop's to the next step."""
        self.phases[-1][f"cpu_{at}"] = time.thread_time()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.base_ms > 0:
            time.sleep(self.base_ms / 1000.0)
        if self.slowed and self.slow_factor > 1:
            # k - 1 times its own recent compute (the median: one noisy step is not amplified)
            self.own = [*self.own[-9:], time.perf_counter() - self.start]
            time.sleep((self.slow_factor - 1) * statistics.median(self.own))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.durations.append(time.perf_counter() - self.start)
        if batch_idx == self.steps - 1:
            self._end_window(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # async: one epoch of leased batches, in which this rank may take fewer or more steps
        if self.window and "steps" not in self.window:
            self._end_window()
        overlap = getattr(trainer.strategy, "overlap", None)  # ps's overlapped push: its per-step timestamps
        if overlap is not None:
            self.push_timeline = [dataclasses.asdict(t) for t in overlap.push.timeline]

    def _quiesce(self, trainer: pl.Trainer) -> None:
        """Under ps (its pull overlaps the next forward), nothing of a step outside the timed ones is on the
        wire when the counters are read: the values in flight land, then every rank meets (every shard's
        replies are then out). Without it the counters caught part of the step before's replies: 1.08-1.17
        x the formula over 4 timed steps in results/cluster_ps_hover.txt (#28). Not under async: its ranks take
        different numbers of steps, so a rank with fewer than ``--steps`` never meets the others (the barrier
        paired with the fit's last one: async_flat failed at step 7 in results/cluster_async_hier.txt)."""
        if isinstance(trainer.strategy, AsyncParameterServerStrategy):
            return
        wait = getattr(trainer.strategy, "wait_for_pulls", None)
        if wait is not None:
            wait()
            dist.barrier()

    def _end_window(self, trainer: pl.Trainer | None = None) -> None:
        self.window["steps"] = len(self.durations) - self.warmup
        self.window["wall"] = time.perf_counter() - self.window["wall"]
        self.window["cpu"] = time.process_time() - self.window["cpu"]
        end = thread_cpu()
        self.threads = {k: v - self.threads.get(k, 0.0) for k, v in end.items()}
        if trainer is not None:
            self._quiesce(trainer)  # after the clocks: its barrier is no step's
        if self.local0:
            self.nic["end"] = nic_counters()
        if self.sampler is not None:
            self.sampler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the times and the bytes")
    parser.add_argument("--batch", type=int, default=32, help="per data-parallel replica")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--base-ms", type=float, default=0.0)
    parser.add_argument("--backward-ms", type=float, default=0.0, help="the backward's sleep (MLP)")
    parser.add_argument("--slow-node-factor", type=float, default=1.0)
    parser.add_argument("--link-sample-ms", type=float, default=0.0, help="> 0: the link's counters every this many ms")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error(f"found --warmup {args.warmup} --steps {args.steps}: expected 0 < warmup < steps")
    torch.set_num_threads(1)
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // per_node
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    model = MLP(args.width, args.layers, args.backward_ms)
    # Data-parallel replicas each take --batch; the pipeline's one replica and a tensor-parallel
    # group (the whole world here) take the global batch, so every strategy steps the same samples.
    batch = args.batch * world if args.strategy in ("pipeline", "tensor") else args.batch
    g = torch.Generator().manual_seed(0)
    asynchronous = args.strategy.startswith("async")
    n = batch * args.steps * (world if asynchronous else 1)
    data = TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))
    measure = Measure(steps=args.steps, warmup=args.warmup, base_ms=args.base_ms,
                      slow_factor=args.slow_node_factor, slowed=node == nodes - 1,
                      link_sample_ms=args.link_sample_ms)  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=nodes,
        strategy=make_strategy(args.strategy),
        # async hands out batches by lease (ranks take different numbers of steps): it refuses
        # max_steps, so it trains one epoch of world x --steps batches, --steps per rank on average
        max_steps=-1 if asynchronous else args.steps,
        max_epochs=1 if asynchronous else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[measure],
    )
    if args.strategy == "ps_local_sigterm":
        # what Lightning's blocking SIGTERM broadcast before every step costs ps (each rank checks its own flag)
        per_rank_sigterm(trainer)
    trainer.fit(model, DataLoader(data, batch_size=batch, drop_last=True))
    record = {
        "rank": rank,
        "node": node,
        "strategy": args.strategy,
        "durations": measure.durations,
        "steps": len(measure.durations),
        "warmup": args.warmup,
        "nic": measure.nic,
        "phases": measure.phases,
        "window": measure.window,
        "thread_cpu_s": measure.threads,
        "push_timeline": measure.push_timeline,
        "link_samples": measure.sampler.rows if measure.sampler is not None else [],
        "link_tcp": measure.sampler.tcp if measure.sampler is not None else {},
        "params": sum(p.numel() for p in MLP(args.width, args.layers).parameters()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0 and os.environ.get("EMULATED_CLUSTER_STEPS_FILE"):
        Path(os.environ["EMULATED_CLUSTER_STEPS_FILE"]).write_text(str(args.steps))
    if dist.is_initialized() and args.strategy != "pipeline":
        dist.destroy_process_group()  # as tests/integration/_torchrun_fit.py: pipeline's teardown does it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
