"""Constants for the scale model: calibrated on this machine (:func:`machine_costs`) or stated for a cluster
(:class:`Cluster`, :func:`cluster_costs`). Pure arithmetic, no torch.

A calibration repetition (``benchmarks/_scale_measure.py``) gives seconds of micro-benchmarks; this
turns them into the model's :class:`~lightning_strategies.advisor.model.Costs`:

    compute_s          the stand-in alone on rank 0 (the others idle in a barrier)
    cores              P x alone / (all P ranks at once): the cores the P processes effectively get
                       (other jobs on the machine included), at least 1
    hop_s              ``wake_<b>_s``: the mean latency of a pipeline hop (an ``isend`` of one activation,
                       the receive posted before or after it) while b processes besides the receiver
                       compute (the sender going on to its next chunk, ranks 2 .. spinning), b = 0 .. P-1
    intra = inter      gloo's link: bandwidth from a 4 MiB exchange (each way at once, ranks 0 and 1
                       alone: a ring step at P = 2), latency from a 4-byte ``all_reduce`` of the pair
                       (2 messages); both divided by contention(2)
    ring_overhead_s    a tiny ``ring_all_reduce`` of the pair (2 messages), per message, minus gloo's
    reduce_s_per_byte  ``a.add_(b)`` of 4 MiB, per byte
    chunk_overhead_s   the runtime's work per chunk: the main thread's CPU seconds of a tiny 2-stage
                       pipeline of the pair (blocks 8 wide: no compute to speak of) over its 2M chunks
                       per stage (CPU time, so none of its waits: those are ``hop_s``'s)
    rpc_exchange_s     every rank echoes D/P off every other rank at once (RPC, the runs' threads)
    rpc_gather_s       ranks 1 .. P-1 echo D off rank 0 at once
    ps_protocol_s      a tiny ps ``push_pull`` of the pair (one remote peer each) less its host work
                       and its transport (a tiny echo of the pair, both at once)
    rpc_overhead_s     the same tiny ``push_pull`` less its host work, per message (for the
                       projection's formula); never below half a 4 KiB RPC round trip
    rpc_intra          bandwidth from a 4 MiB RPC round trip (payload both ways)
    ps_*_s_per_*       ps's host work in rank 0 alone with a local shard (no RPC), over the model's
                       tensors at full size and at 16 elements each: per tensor and per byte

The figures come from two kinds of world (``_scale_measure.py``): the process group alone
(``coll``: gloo, the ring, the pipeline) and with RPC (``rpc``: the ps figures), as the
strategies that use them run; ``calib`` holds one kind's, and the other kind's constants keep
their defaults.

Two kinds of figure: *work* (compute, copies, per-byte and per-tensor host work: what a busy
process does) and *latency* (:data:`LATENCY_KEYS`: the tiny instances of each protocol, which
mostly wait for the other process to wake up). On a shared machine the first slows in proportion
to the CPU other jobs take, which the probe before each step measures (:func:`slower`); the
second is heavy-tailed (a wake-up waits behind whatever else is runnable) and no probe short
enough to take before every step reads it, so it enters as its typical (median) value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from lightning_strategies.advisor.model import MIB, Costs, Link, Workload, contention, pipeline_makespan

__all__ = [
    "CALIB_BIG",
    "CALIB_SMALL",
    "LATENCY_KEYS",
    "Cluster",
    "cluster_costs",
    "cluster_workload",
    "effective_cores",
    "hop_table",
    "machine_costs",
    "pipeline_chunk_overhead",
    "slower",
    "solve_chunk_overhead",
]

CALIB_SMALL, CALIB_BIG = 4096, 4 * MIB  # bytes of the calibration messages (see _scale_measure.calibrate)
#: the calibration figures that are message latencies (median over repetitions); the rest are work (minimum)
LATENCY_KEYS = frozenset(
    {
        "exchange_small_s", "gloo_tiny_allreduce_s", "ring_tiny_s", "rpc_small_s", "ps_pair_tiny_s",
        "pipeline_tiny_s", "rpc_exchange_tiny_s",
    }
    | {f"wake_{b}_s" for b in range(64)}
)  # fmt: skip
RING_MIN_CHUNK_BYTES = 256 << 10  # comm.ring.MIN_CHUNK_BYTES: the ring strategy's buckets grow to P x this


def effective_cores(world: int, alone_s: float, together_s: float, cpus: float | None = None) -> float:
    """Cores ``world`` processes get: P x (the stand-in alone) / (on all P at once), at least 1 (a lone
    process's speed, whatever the other jobs leave it, is the unit) and at most ``cpus``, the machine's
    (``None``: no bound). P processes never get more cores than the machine has: a probe that says so
    timed steps between the processes' time slices (``benchmarks/_compute_probe.py``)."""
    cores = max(1.0, world * alone_s / together_s)
    return cores if cpus is None else min(cores, max(1.0, cpus))


def slower(costs: Costs, factor: float) -> Costs:
    """``costs`` on a machine ``factor`` times slower for every piece of CPU work: compute, copies (on
    loopback a link's bandwidth is memory copies), host work per byte and per tensor, the pipeline
    runtime's work per chunk (its source is the main thread's CPU time, ``pipeline_tiny_cpu_s``), the training
    loop's host work per step (``loop_s``: ``benchmarks/loop_overhead.py``) and
    the pipeline's hops (a message to a waiting stage waits for a core, behind whatever else is
    runnable). Per-message latencies of the links are left as they are (see the module's
    docstring)."""

    def link(x: Link) -> Link:
        return Link(x.latency_s, x.bandwidth / factor)

    return costs.with_(
        compute_s=costs.compute_s * factor,
        intra=link(costs.intra),
        inter=link(costs.inter),
        reduce_s_per_byte=costs.reduce_s_per_byte * factor,
        rpc_intra=link(costs.rpc_intra),
        rpc_inter=link(costs.rpc_inter),
        # a transport on loopback is copies: CPU work
        rpc_exchange_s=None if costs.rpc_exchange_s is None else costs.rpc_exchange_s * factor,
        rpc_gather_s=None if costs.rpc_gather_s is None else costs.rpc_gather_s * factor,
        # a hop waits for a core behind the same runnable processes that slow the work down
        hop_s=tuple(h * factor for h in costs.hop_s),
        ps_client_s_per_byte=costs.ps_client_s_per_byte * factor,
        ps_average_s_per_byte=costs.ps_average_s_per_byte * factor,
        ps_update_s_per_byte=costs.ps_update_s_per_byte * factor,
        ps_client_s_per_tensor=costs.ps_client_s_per_tensor * factor,
        ps_average_s_per_tensor=costs.ps_average_s_per_tensor * factor,
        ps_update_s_per_tensor=costs.ps_update_s_per_tensor * factor,
        tensor_layer_s=costs.tensor_layer_s * factor,
        chunk_overhead_s=costs.chunk_overhead_s * factor,
        loop_s=costs.loop_s * factor,
    )


def ps_host_costs(calib: Mapping[str, float], tensors: int, grad_bytes: float) -> dict[str, float]:
    """ps's host work per tensor (from the runs over tiny tensors) and per byte (the full-size runs
    less the tiny ones), for the client, the shard's update and its averaging of one push."""
    update_t, two_t, local_t = calib["ps_update_tiny_s"], calib["ps_two_tiny_s"], calib["ps_local_tiny_s"]
    update, two, local = calib["ps_update_s"], calib["ps_two_s"], calib["ps_local_s"]
    return {
        "ps_update_s_per_tensor": update_t / tensors,
        "ps_average_s_per_tensor": max(0.0, two_t - update_t) / (2 * tensors),
        "ps_client_s_per_tensor": max(0.0, local_t - update_t) / tensors,
        "ps_update_s_per_byte": max(0.0, update - update_t) / grad_bytes,
        "ps_average_s_per_byte": max(0.0, (two - update) - (two_t - update_t)) / (2 * grad_bytes),
        "ps_client_s_per_byte": max(0.0, (local - update) - (local_t - update_t)) / grad_bytes,
    }


def hop_table(calib: Mapping[str, float], world: int) -> tuple[float, ...]:
    """``wake_<b>_s`` for b = 0 .. P-1 (as far as measured): the latency of a hop with b others busy."""
    out = []
    for b in range(world):
        if f"wake_{b}_s" not in calib:
            break
        out.append(calib[f"wake_{b}_s"])
    return tuple(out)


def solve_chunk_overhead(tiny_s: float, microbatches: int, hop: tuple[float, ...], cores: float | None) -> float:
    """The runtime's work per chunk ``o`` for which the pipeline model of the tiny 2-stage pipeline
    (chunks of ``o`` alone, hops ``hop``, ``cores``) lasts ``tiny_s``: the model inverted on a
    calibration run, by bisection (its span grows with ``o``); 0 when the hops alone take longer."""
    costs = Costs(compute_s=0.0, local_size=2, intra=Link(0.0, math.inf), inter=Link(0.0, math.inf), hop_s=hop)

    def span(o: float) -> float:
        return pipeline_makespan(2, microbatches, o, o, hop=lambda b: costs.hop(b, costs.intra), cores=cores)

    lo, hi = 0.0, max(tiny_s, 1e-9)
    if span(lo) >= tiny_s:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < tiny_s else (lo, mid)
    return (lo + hi) / 2


def pipeline_chunk_overhead(
    calib: Mapping[str, float], microbatches: int, hop: tuple[float, ...], cores: float | None
) -> float:
    """The runtime's work per chunk: the tiny pipeline's CPU seconds per stage over its 2M chunks
    (``pipeline_tiny_cpu_s``: work only, no wait can enter it), else its wall time with the
    model inverted (:func:`solve_chunk_overhead`), else 0."""
    if "pipeline_tiny_cpu_s" in calib:
        return calib["pipeline_tiny_cpu_s"] / (2 * microbatches)
    if "pipeline_tiny_s" in calib:
        return solve_chunk_overhead(calib["pipeline_tiny_s"], microbatches, hop, cores)
    return 0.0


def machine_costs(
    calib: Mapping[str, float],
    world: int,
    *,
    tensors: int,
    grad_bytes: float,
    probe: Mapping[str, float] | None = None,
    local_size: int | None = None,
) -> Costs:
    """This machine's :class:`Costs` from the calibration figures of a ``world``-process run.

    Args:
        calib: the ``calib/`` figures, without the prefix (one world kind's: the other kind's
            constants keep their defaults).
        world: the processes of the run (P).
        tensors: the tensors of the measured model (the ps figures are over them).
        grad_bytes: their bytes.
        probe: what was measured just before the step to predict: ``alone_s`` and ``all_s``, the
            stand-in on rank 0 alone and on all P at once. The costs are scaled to the machine's
            speed of that moment (alone over the calibration's alone; on loopback every message is
            CPU work too), with that moment's contention.
        local_size: processes per simulated node (torchrun's ``--nproc-per-node``); default all.
    """
    alone, together = calib["compute_s"], calib["compute_all_s"]
    cores = effective_cores(world, alone, together)
    pair = contention(2, cores)
    hops = hop_table(calib, world)
    costs = Costs(
        compute_s=alone,
        local_size=local_size or world,
        intra=Link(0.0, math.inf),
        inter=Link(0.0, math.inf),
        inter_shared=False,  # loopback: no NIC shared by a node's processes
        reduce_s_per_byte=calib["add_big_s"] / CALIB_BIG,
        hop_s=hops,
        cores=cores,
        min_chunk_bytes=RING_MIN_CHUNK_BYTES,
    )
    if "exchange_big_s" in calib:  # a world of the process group alone
        x_bandwidth = CALIB_BIG / (calib["exchange_big_s"] / pair)  # 4 MiB: latency is < 2% of it
        gloo_latency = calib["gloo_tiny_allreduce_s"] / 2 / pair  # one exchange per phase at P = 2
        link = Link(gloo_latency, x_bandwidth)
        m = int(calib.get("microbatches", 1.0))
        chunk = pipeline_chunk_overhead(calib, m, hops, cores)
        costs = costs.with_(
            intra=link,
            inter=link,
            # a tiny ring call of the pair: 2 steps of one message each, the call's own work included
            ring_overhead_s=max(0.0, calib["ring_tiny_s"] / pair / 2 - gloo_latency),
            chunk_overhead_s=chunk,
        )
    if "rpc_big_s" in calib:  # a world with RPC
        rpc_bandwidth = 2 * CALIB_BIG / calib["rpc_big_s"]
        host = ps_host_costs(calib, tensors, grad_bytes)
        # the ps protocol's tiny push_pull of ranks 0 and 1 (2 shards): each rank's client work over
        # every tensor, its shard's update of half of them and averaging of both pushes, and 2 messages
        tiny_host = tensors * (host["ps_client_s_per_tensor"] + host["ps_update_s_per_tensor"] / 2)
        tiny_host += tensors * host["ps_average_s_per_tensor"]
        tiny = calib["ps_pair_tiny_s"] / pair
        # never below a bare RPC's half round trip (the difference of two noisy figures can be)
        rpc_overhead = max(calib["rpc_small_s"] / 2, (tiny - tiny_host) / 2)
        costs = costs.with_(
            rpc_overhead_s=rpc_overhead,
            rpc_intra=Link(0.0, rpc_bandwidth),
            rpc_inter=Link(0.0, rpc_bandwidth),
            rpc_exchange_s=calib.get("rpc_exchange_s"),
            rpc_gather_s=calib.get("rpc_gather_s"),
            ps_protocol_s=max(0.0, tiny - tiny_host - calib.get("rpc_exchange_tiny_s", 0.0)),
            **host,
        )
    if probe is None:
        return costs
    cores_now = effective_cores(world, probe["alone_s"], probe["all_s"])
    return slower(costs, probe["alone_s"] / alone).with_(cores=cores_now)


@dataclass(frozen=True)
class Cluster:
    """The cluster the projection is for; every figure a command-line flag (``--<name>``).

    Each field's comment says where its default comes from: a cited figure, the issue's
    example, or an assumption (labelled so).
    """

    gpus_per_node: int = 8  # the example (DGX A100 / H100: 8 GPUs per node)
    nvlink_gbyte_s: float = 300.0  # per GPU, one direction (the issue; NVLink 3 is 600 GB/s both ways)
    nvlink_latency_us: float = 5.0  # per hop, assumed (NCCL's small-message floor inside a node is a few us)
    nic_gbit_s: float = 100.0  # Gb/s per node between nodes (the example)
    nic_latency_us: float = 10.0  # per hop, assumed (IB/RoCE plus NCCL's proxy)
    step_ms: float = 1000 * 256 / 2470  # forward+backward per GPU: 256 images at 2470 img/s, 1x A100 80GB AMP (*)
    batch_per_gpu: int = 256  # the batch of that figure (NVIDIA's configs.yml: resnet50 DGXA100 AMP)
    params: int = 25_557_032  # ResNet-50 (torchvision) trainable parameters, fp32 gradients
    tensors: int = 161  # ResNet-50's trainable tensors
    hbm_gbyte_s: float = 1500.0  # effective HBM bandwidth for reductions and copies, assumed (A100 80GB: 2039 peak)
    rpc_overhead_us: float = math.nan  # host work per RPC message; nan: this machine's calibrated figure
    ring_overhead_us: float = math.nan  # host work per comm.ring message (a Python send/recv); nan: calibrated
    chunk_overhead_us: float = math.nan  # pipeline runtime per chunk; nan: calibrated
    stages: int = 4  # pipeline stages (inside a node)
    microbatches: int = 8  # pipeline micro-batches per step
    activation_per_image: int = 512 * 28 * 28  # values at a stage boundary (ResNet-50 layer2's output), bf16
    overlap: float = 0.0  # share of the backward pass (2/3 of compute) that hides ddp's / the ring's buckets

    def resolved(self, calibrated: Costs) -> Cluster:
        """The figures in use: a ``nan`` host overhead replaced by this machine's calibrated one."""

        def pick(given: float, seconds: float) -> float:
            return seconds * 1e6 if math.isnan(given) else given

        return replace(
            self,
            rpc_overhead_us=pick(self.rpc_overhead_us, calibrated.rpc_overhead_s),
            ring_overhead_us=pick(self.ring_overhead_us, calibrated.ring_overhead_s),
            chunk_overhead_us=pick(self.chunk_overhead_us, calibrated.chunk_overhead_s),
        )

    def describe(self) -> list[tuple[str, float, str]]:
        """``(name, value, unit)`` of every figure, for the output."""
        units = {
            "gpus_per_node": "gpus", "nvlink_gbyte_s": "GB/s", "nvlink_latency_us": "us", "nic_gbit_s": "Gb/s",
            "nic_latency_us": "us", "step_ms": "ms", "batch_per_gpu": "images", "params": "floats",
            "tensors": "tensors",
            "hbm_gbyte_s": "GB/s", "rpc_overhead_us": "us", "ring_overhead_us": "us",
            "chunk_overhead_us": "us",
            "stages": "stages", "microbatches": "microbatches", "activation_per_image": "values", "overlap": "fraction",
        }  # fmt: skip
        return [(f.name, float(getattr(self, f.name)), units[f.name]) for f in fields(self)]


#: where the defaults of :class:`Cluster` come from (printed with the output and in README)
STEP_SOURCE = (
    "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, 'Training "
    "performance: NVIDIA DGX A100 (8x A100 80GB)': 2470 img/s on 1 GPU, mixed precision, batch 256"
)


def cluster_costs(cluster: Cluster, calibrated: Costs) -> Costs:
    """The cluster's :class:`Costs`: links and compute as stated, host overheads calibrated here
    (unless given). GPUs: no contention; NCCL's rings send one message per step (no segments)."""

    cluster = cluster.resolved(calibrated)
    hbm = cluster.hbm_gbyte_s * 1e9
    nvlink = Link(cluster.nvlink_latency_us * 1e-6, cluster.nvlink_gbyte_s * 1e9)
    nic = Link(cluster.nic_latency_us * 1e-6, cluster.nic_gbit_s * 1e9 / 8)
    return Costs(
        compute_s=cluster.step_ms / 1e3,
        local_size=cluster.gpus_per_node,
        intra=nvlink,
        inter=nic,
        inter_shared=True,  # one NIC per node: the flows that leave a node at once share it
        ring_overhead_s=cluster.ring_overhead_us * 1e-6,
        gloo_segment_bytes=math.inf,
        ring_segment_bytes=math.inf,
        reduce_s_per_byte=3 / hbm,  # read two chunks, write one
        rpc_overhead_s=cluster.rpc_overhead_us * 1e-6,
        rpc_intra=nvlink,
        rpc_inter=nic,
        ps_client_s_per_byte=4 / hbm,  # pack (read + write) and copy back (read + write)
        ps_average_s_per_byte=4 / hbm,  # divide (read + write) and add (read + write)
        ps_update_s_per_byte=5 / hbm,  # SGD (read 2, write 1) and the reply's pack (read + write)
        ps_client_s_per_tensor=calibrated.ps_client_s_per_tensor,  # Python loops: the same code's
        ps_average_s_per_tensor=calibrated.ps_average_s_per_tensor,
        ps_update_s_per_tensor=calibrated.ps_update_s_per_tensor,
        chunk_overhead_s=cluster.chunk_overhead_us * 1e-6,
        cores=None,
        min_chunk_bytes=RING_MIN_CHUNK_BYTES,
        overlap_s=cluster.overlap * 2 / 3 * cluster.step_ms / 1e3,
    )


def cluster_workload(cluster: Cluster) -> Workload:
    """ResNet-50's step on the cluster: its fp32 gradient, and the pipeline's boundary activation (bf16)."""
    per_micro = cluster.stages * cluster.batch_per_gpu / cluster.microbatches  # a replica takes K x the batch
    return Workload(
        grad_bytes=4.0 * cluster.params,
        tensors=cluster.tensors,
        stages=cluster.stages,
        microbatches=cluster.microbatches,
        activation_bytes=2.0 * cluster.activation_per_image * per_micro,
    )
