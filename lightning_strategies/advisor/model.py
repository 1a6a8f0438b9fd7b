"""The scale model: step time and bytes per link of every strategy (``benchmarks/scale.py`` validates it).

Pure arithmetic (no torch), one function per strategy, so ``tests/unit/test_scale_model_*.py`` hold
the formulas to hand-computed values. A strategy's step is a list of *phases*; a phase is work that
``busy`` processes do at once, and costs ``contention(busy) x seconds``:

    contention(b) = max(1, b / cores)

``cores`` is the number of cores the processes effectively get (``Costs.cores``): on the 2-vCPU
development machine, where P = 3 or 4 CPU processes (and other jobs) share the cores, a phase in
which every process computes or copies bytes takes b / cores times longer than alone. On a GPU
cluster every process has its own device and NIC queue: ``cores=None``, no contention.

Where processes do not work in lockstep (the pipeline) a phase is not a slot of the whole world:
:func:`pipeline_makespan` runs the schedule as a simulation instead, processes sharing ``cores``
(processor sharing: n busy processes each progress at min(1, cores / n)), and a message to a
process blocked in ``recv`` reaching it ``Costs.hop_s[b]`` later, b the processes busy when it is
sent: on an oversubscribed machine a message waits for a core on either side (measured, not assumed).

Every strategy's step also pays the training loop (``costs.with_loop``: each process's ``Costs.loop_s`` and
its own optimizer step, ``Workload.optimizer_s``, under contention), added by :func:`predict`.

Notation: P processes, L per node (``Costs.local_size``), M = P / L nodes; D = gradient bytes
(``Workload.grad_bytes``); buckets D_b (DDP's: 1 MiB first, then 25 MiB); a link moves a message of
B bytes in ``latency + B / bandwidth``.

    ddp        the backend's ring all-reduce per bucket (gloo's on CPU, NCCL's ring on GPUs):
               2(P-1) steps of D_b / P, in segments; every rank sends 2(P-1)/P x D; across nodes a
               flat ring's every step waits for the inter-node hop, whose bytes move at
               ``Costs.ring_share`` of the link's goodput (measured: a ring's steps use the link less
               well than one stream; every ring between nodes below, ring_hier's and tensor's too)
    ring       the same schedule run by ``comm.ring`` (Python send/recv per segment: its own
               per-message cost)
    ring_bf16  the ring on bf16 copies of fp32 buckets: half the bytes, the same messages
    ring_hier  reduce-scatter in the node (L-1 steps of D_b/L), L rings across the M nodes on D_b/L
               (2(M-1) steps of D_b/(L M), sharing the node's NIC), all-gather in the node: per
               worker 2(L-1)/L x D intra and 2(M-1)/M x D/L inter-node bytes; latency terms
               2(L-1) + 2(M-1) instead of the flat ring's 2(P-1)
    ps_flat    sharded servers, shard s on rank s: every worker sends each of the P-1 remote shards
               its D/P and each shard answers P-1 remote workers: 2(P-1)/P x D sent per rank, as the
               ring, but 2(P-1) RPC messages per rank and per step. Its transport is either the
               links' formula or, measured (``Costs.rpc_exchange_s``), every rank echoing D/P off
               every peer at once; the protocol on top (the barrier, the RPC threads' hand-offs)
               costs ``ps_protocol_s`` per remote peer
    ps         ps_flat on one node; on N > 1 nodes of L > 1 the hierarchical push (``advisor.push``):
               the backend's reduce-scatter and all-gather of D in the node, per bucket (ring_hier's
               in-node ring, without its Python overhead; on gloo, ``Costs.node_all_reduce``, a whole
               all-reduce in place of the reduce-scatter) around 2(N-1) RPC messages per rank of D/P
               (each barrier waits for N pushers): a node's NIC carries 2(N-1)/N x D, ring_hier's; the
               client still packs and copies back D; the links' formula (``rpc_exchange_s`` is a
               flat exchange). Bytes between nodes move at the exchange's measured share of the link's
               goodput: ``Costs.all_to_all_share`` for the flat push (many flows through a node's link at
               once), ``Costs.hier_push_share`` for the hierarchical one. Both ps: pushes
               per bucket during backward,
               hidden up to ``overlap_s`` as ddp's; the pull's overlap with the next forward is not
               modelled (nothing measured yet)
    ps_1       one server (rank 0): it receives (P-1) x D and sends (P-1) x D, the seed's bottleneck,
               growing linearly with P; the pushes and then the replies, one direction of its link at a
               time (at the one-way goodput: ``Costs.duplex_share``); measured transport
               ``Costs.rpc_gather_s`` (P-1 ranks echoing D off rank 0 at once: the server's one process
               serialises them); its averaging of P
               pushes and its update run on one core while the workers wait
    async      each push applied alone on arrival, no barrier (no overlap: a push waits for its
               reply). On one node (or L = 1): ps_flat's messages, P asynchronous workers. On N > 1
               nodes of L > 1 the node is the worker (``comm.async_hierarchy``): ps's hierarchical
               traffic (the node's sum and all-gather of D, one buffer per step, 2(N-1) RPC
               messages of D/P per rank, a node's NIC 2(N-1)/N x D), a shard applying N pushes per
               round, and the leader's draw shared in the node (a broadcast of its size and its
               bytes: 2 ceil(log2 L) hops of ``rpc_intra``'s latency). Batches from a local lease of
               ``async_lease`` (4) refilled by the coordinator (rank 0) when half is used: one refill
               round trip per lease/2 steps, in the background; the coordinator serves the other
               workers' (P-1 flat, N-1 nodes) refills
    pipeline   K stages x R = P/K replicas, M micro-batches, GPipe: simulated (:func:`pipeline_makespan`):
               each stage forwards its M micro-batches, then runs their backward, a chunk starting
               when its input has arrived and a core is free; with one core per process and no
               wake-ups it is (M+K-1) chunks forward and backward plus 2(K-1) transfers on the
               critical path. With R > 1, a ring all-reduce of D/K over the replicas
    tensor     T = P / R processes split every planned layer (share s of the compute and of D) and
               take T x the data-parallel batch: s + T(1 - s) of a worker's compute per device,
               a ring all-reduce over T of each activation payload (``Workload.tensor_collectives``,
               forward and backward); a rank's shards ((D - W) / T) in a ring over the R replicas,
               the gradients left whole on every rank (W: the unsplit layers, a row-split layer's
               bias; ``Workload.tensor_replicated_bytes``) in a ring over all P; and DTensor's host
               work, ``tensor_layer_s`` per split layer (``Workload.tensor_layers``)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from lightning_strategies.advisor.costs import (
    MIB,
    Costs,
    Link,
    Prediction,
    Workload,
    contention,
    ddp_buckets,
    with_loop,
)
from lightning_strategies.advisor.push import push_traffic
from lightning_strategies.advisor.schedule import pipeline_busy, pipeline_makespan

__all__ = [
    "MIB",
    "STRATEGIES",
    "Costs",
    "Link",
    "Prediction",
    "Workload",
    "contention",
    "ddp_buckets",
    "pipeline_busy",
    "pipeline_makespan",
    "predict",
]


STRATEGIES = (
    "ddp", "ring", "ring_hier", "ring_bf16", "ps", "ps_flat", "ps_1", "ps_ring", "async", "pipeline", "tensor",
)  # fmt: skip


def _segments(nbytes: float, segment: float) -> float:
    return 1.0 if math.isinf(segment) or nbytes <= 0 else max(1.0, math.ceil(nbytes / segment))


def _ring(
    costs: Costs, world: int, buckets: Sequence[float], *, segment: float, overhead: float, rings: int = 1
) -> tuple[float, float, float]:
    """(latency, bandwidth, reduce) seconds of a flat ring all-reduce of ``buckets`` over ``world`` ranks.

    Across nodes every step waits for the slowest hop, the inter-node one; the ring enters and
    leaves each node once, so one flow per node crosses it (``rings`` flows when that many rings
    run at once and the node's NIC is shared: ``Costs.inter_shared``), at ``Costs.ring_share`` of the
    link's goodput.
    """
    if world <= 1:
        return 0.0, 0.0, 0.0
    across = world > costs.local_size
    link = costs.inter if across else costs.intra
    rate = link.bandwidth * (costs.ring_share if across else 1.0)
    flows = rings if across and costs.inter_shared else 1
    latency = bandwidth = reduce = 0.0
    for b in buckets:
        chunk = b / world
        latency += 2 * (world - 1) * _segments(chunk, segment) * (link.latency_s + overhead)
        bandwidth += 2 * (world - 1) * flows * chunk / rate
        reduce += (world - 1) * chunk * costs.reduce_s_per_byte
    return latency, bandwidth, reduce


def _overlapped(phases: dict[str, float], costs: Costs) -> float:
    """The step: compute, plus the communication not hidden under the backward pass (``overlap_s``)."""
    comm = sum(v for k, v in phases.items() if k != "compute")
    hidden = min(comm, costs.overlap_s)
    if hidden:
        phases["overlapped"] = -hidden
    return phases["compute"] + comm - hidden


def _flat_ring(strategy: str, costs: Costs, world: int, work: Workload) -> Prediction:
    ring = strategy != "ddp"
    wire = 0.5 if strategy == "ring_bf16" else 1.0  # buckets are cut in fp32, sent as bf16
    segment = costs.ring_segment_bytes if ring else costs.gloo_segment_bytes
    overhead = costs.ring_overhead_s if ring else 0.0
    buckets = [wire * b for b in costs.buckets(work.grad_bytes, world, grow=ring)]
    latency, bandwidth, reduce = _ring(costs, world, buckets, segment=segment, overhead=overhead)
    k = contention(world, costs.cores)
    bw = costs.wire(world)
    phases = {"compute": k * costs.compute_s, "latency": k * latency, "bandwidth": bw * bandwidth, "reduce": k * reduce}
    sent = 2 * (world - 1) / world * work.grad_bytes * wire
    messages = sum(2 * (world - 1) * _segments(b / world, segment) for b in buckets) if world > 1 else 0.0
    nodes = math.ceil(world / costs.local_size)
    across = sent if nodes > 1 else 0.0  # the rank before each node boundary sends all of it across
    return Prediction(_overlapped(phases, costs), phases, sent, sent, across, messages, inter_sent_bytes=across)


def _hier_ring(costs: Costs, world: int, work: Workload) -> Prediction:
    local = min(costs.local_size, world)
    if world % local:
        raise ValueError(f"ring_hier needs whole nodes: found P={world} with {local} per node")
    nodes = world // local
    buckets = costs.buckets(work.grad_bytes, world, grow=True)
    seg, over = costs.ring_segment_bytes, costs.ring_overhead_s
    flows = local if costs.inter_shared else 1  # the L inter-node rings leave the node at once
    latency = bandwidth = reduce = 0.0
    messages = 0.0
    for b in buckets:
        if local > 1:  # reduce-scatter then all-gather inside the node: L-1 steps of b/L each
            n = 2 * (local - 1) * _segments(b / local, seg)
            latency += n * (costs.intra.latency_s + over)
            bandwidth += 2 * (local - 1) * (b / local) / costs.intra.bandwidth
            reduce += (local - 1) * (b / local) * costs.reduce_s_per_byte
            messages += n
        if nodes > 1:  # a ring over the nodes on this rank's 1/L of the bucket
            piece = b / local / nodes
            n = 2 * (nodes - 1) * _segments(piece, seg)
            latency += n * (costs.inter.latency_s + over)
            bandwidth += 2 * (nodes - 1) * flows * piece / (costs.inter.bandwidth * costs.ring_share)
            reduce += (nodes - 1) * piece * costs.reduce_s_per_byte
            messages += n
    k, bw = contention(world, costs.cores), costs.wire(world)
    phases = {"compute": k * costs.compute_s, "latency": k * latency, "bandwidth": bw * bandwidth, "reduce": k * reduce}
    d = work.grad_bytes
    intra_bytes = 2 * (local - 1) / local * d
    inter_bytes = 2 * (nodes - 1) / nodes * d / local  # per worker
    nic = local * inter_bytes if nodes > 1 else 0.0
    return Prediction(
        _overlapped(phases, costs), phases, intra_bytes + inter_bytes, max(intra_bytes, nic), nic, messages,
        inter_sent_bytes=inter_bytes,
    )  # fmt: skip


def _rpc_bytes_seconds(
    costs: Costs, world: int, per_peer: float, peers_off_node: float, peers_on_node: float, *, share: float = 1.0
) -> float:
    """Seconds for one process to send ``per_peer`` bytes to each of its peers, inside and across
    nodes at once (the larger of the two), the node's NIC shared by its L processes when
    ``inter_shared``, at ``share`` of the link's goodput (the exchange's own: ``all_to_all_share`` for the
    flat push, ``hier_push_share`` for the hierarchical one)."""
    intra = peers_on_node * per_peer / costs.rpc_intra.bandwidth
    flows = min(costs.local_size, world) if costs.inter_shared else 1
    inter = flows * peers_off_node * per_peer / (costs.rpc_inter.bandwidth * share)
    return max(intra, inter)


def _node_collectives(costs: Costs, world: int, local: int, buckets: Sequence[float]) -> float:
    """The hierarchical push's collectives inside a node (``comm.ps.hierarchy``), per bucket: the node's sum,
    a reduce-scatter (L-1 steps of b/L), or on gloo an all-reduce of the whole buffer (2(L-1) steps: gloo's
    reduce-scatter took 1.7 x it, ``Costs.node_all_reduce``), then an all-gather of the chunks (L-1 steps)."""
    if local <= 1:
        return 0.0
    link, seg = costs.intra, costs.gloo_segment_bytes
    steps = (2 if costs.node_all_reduce else 1) * (local - 1) + (local - 1)
    latency = bandwidth = reduce = 0.0
    for b in buckets:
        chunk = b / local
        latency += steps * _segments(chunk, seg) * link.latency_s
        bandwidth += steps * chunk / link.bandwidth
        reduce += (local - 1) * chunk * costs.reduce_s_per_byte
    return contention(world, costs.cores) * (latency + reduce) + costs.wire(world) * bandwidth


def _push_share(costs: Costs, hierarchical: bool) -> float:
    """The ps / async exchange's share of the link's goodput: the hierarchical push's or the flat one's."""
    return costs.hier_push_share if hierarchical else costs.all_to_all_share


def _client_host(costs: Costs, work: Workload) -> float:
    """A ps worker's packing of its gradients and copying back of the values, every tensor."""
    return work.tensors * costs.ps_client_s_per_tensor + work.grad_bytes * costs.ps_client_s_per_byte


def _shard_host(costs: Costs, work: Workload, share: float, pushes: int, averaged: bool) -> float:
    """A shard holding ``share`` of the model: ``pushes`` workers' gradients averaged (sync) and one
    update, or (async, ``averaged=False``) ``pushes`` updates, one per push."""
    tensors, nbytes = share * work.tensors, share * work.grad_bytes
    update = tensors * costs.ps_update_s_per_tensor + nbytes * costs.ps_update_s_per_byte
    if not averaged:
        return pushes * update
    average = tensors * costs.ps_average_s_per_tensor + nbytes * costs.ps_average_s_per_byte
    return update + (pushes * average if pushes > 1 else 0.0)


def _ps(costs: Costs, world: int, work: Workload, *, hierarchical: bool = True) -> Prediction:
    d, p = work.grad_bytes, world
    t = push_traffic(p, costs.local_size, d, hierarchical=hierarchical, node_all_reduce=costs.node_all_reduce)
    k = contention(p, costs.cores)
    phases = {
        "compute": k * costs.compute_s,
        "host": k * (_client_host(costs, work) + _shard_host(costs, work, 1 / p, t.pushers, averaged=True)),
    }
    if t.hierarchical:  # the node's sum before the pushes and its all-gather after the replies, per bucket
        phases["node"] = _node_collectives(costs, p, t.local, costs.buckets(d))
    if costs.rpc_exchange_s is not None and p > 1 and not t.hierarchical:  # measured at these sizes and peers
        phases["transport"] = costs.rpc_exchange_s
        phases["protocol"] = (p - 1) * costs.ps_protocol_s
    elif t.messages:
        link = costs.rpc_inter if t.nodes > 1 else costs.rpc_intra
        wire = 2 * _rpc_bytes_seconds(costs, p, t.message_bytes, t.peers_off_node, t.peers_on_node,
                                      share=_push_share(costs, t.hierarchical))  # fmt: skip
        phases.update(messages=k * t.messages * costs.rpc_overhead_s, bandwidth=costs.wire(p) * wire,
                      latency=2 * link.latency_s)  # a push and its reply  # fmt: skip
    return Prediction(_overlapped(phases, costs), phases, t.sent_bytes, t.link_bytes, t.nic_bytes, t.messages,
                      inter_sent_bytes=t.inter_sent_bytes)  # fmt: skip


def _ps_ring(costs: Costs, world: int, work: Workload) -> Prediction:
    """ps's shards on the ring's halves: the ring's exchange, hierarchical on several nodes of several processes (as
    ``RingParameterServerStrategy``), flat otherwise; its optimizer steps ``1/P`` (``Workload.optimizer_s``)."""
    local = min(costs.local_size, world)
    return _hier_ring(costs, world, work) if world > local > 1 else _flat_ring("ring", costs, world, work)


def _ps_1(costs: Costs, world: int, work: Workload) -> Prediction:
    """One server on rank 0: every push to it, then (after the barrier) every reply from it."""
    d, p = work.grad_bytes, world
    local = min(costs.local_size, p)
    nodes = math.ceil(p / local)
    off, on = p - local, local - 1
    k = contention(p, costs.cores)
    server = contention(1, costs.cores)
    # the server's link carries (P-1) D in, then (P-1) D out: no flow shares its own NIC with it, and one
    # direction at a time runs at the one-way goodput
    oneway = costs.rpc_inter.bandwidth / costs.duplex_share
    shared = costs.with_(inter_shared=False, rpc_inter=Link(costs.rpc_inter.latency_s, oneway))
    wire = 2 * _rpc_bytes_seconds(shared, p, d, off, on)
    wire_latency = 2 * (costs.rpc_inter if nodes > 1 else costs.rpc_intra).latency_s if p > 1 else 0.0
    phases = {
        "compute": k * costs.compute_s,
        "host": k * _client_host(costs, work) + server * _shard_host(costs, work, 1.0, p, averaged=True),
    }
    if costs.rpc_gather_s is not None and p > 1:  # the server's transport as measured at these sizes
        phases["transport"] = costs.rpc_gather_s
        phases["protocol"] = (p - 1) * costs.ps_protocol_s
    else:
        phases.update(
            messages=server * 2 * (p - 1) * costs.rpc_overhead_s, bandwidth=server * wire, latency=wire_latency
        )
    sent = (p - 1) * d
    nic = off * d if nodes > 1 else 0.0
    return Prediction(sum(phases.values()), phases, sent, max(d if p > 1 else 0.0, nic), nic, 2 * (p - 1))


def _async(costs: Costs, world: int, work: Workload) -> Prediction:
    """Each push applied alone (an optimizer step on D/P per push, instead of averaging); a lease refill
    round trip every lease/2 steps, off the critical path but host work all the same; no overlap with
    backward (a push waits for its reply): ``overlap_s`` does not apply. On N > 1 nodes of L > 1 the node
    is the worker: ps's hierarchical traffic and node collectives, N pushes per shard and round, the
    leader's draw shared in the node; else ps_flat's traffic with P workers."""
    d, p = work.grad_bytes, world
    t = push_traffic(p, costs.local_size, d, hierarchical=True, node_all_reduce=costs.node_all_reduce)
    k = contention(p, costs.cores)
    refill = 4 / costs.async_lease if p > 1 else 0.0  # 2 messages per refill, one refill per lease/2 steps
    messages = t.messages + refill
    phases = {
        "compute": k * costs.compute_s,
        "host": k * (_client_host(costs, work) + _shard_host(costs, work, 1 / p, t.pushers, averaged=False)),
    }
    if t.hierarchical:  # the node's sum before the pushes, its all-gather after, the leader's draw shared
        phases["node"] = _node_collectives(costs, p, t.local, [d])  # one push per step: the whole gradient
        phases["node_control"] = k * 2 * math.ceil(math.log2(t.local)) * costs.rpc_intra.latency_s
    if costs.rpc_exchange_s is not None and p > 1 and not t.hierarchical:
        # a push to every shard and its reply, as ps's transport; no barrier, but the same RPC
        # hand-offs per peer, and a refill round trip per L/2 steps
        phases["transport"] = costs.rpc_exchange_s
        phases["protocol"] = (p - 1 + refill / 2) * costs.ps_protocol_s
    else:
        link = costs.rpc_inter if t.nodes > 1 else costs.rpc_intra
        wire = 2 * _rpc_bytes_seconds(costs, p, t.message_bytes, t.peers_off_node, t.peers_on_node,
                                      share=_push_share(costs, t.hierarchical))  # fmt: skip
        phases.update(
            messages=k * messages * costs.rpc_overhead_s,
            bandwidth=costs.wire(p) * wire,
            latency=(2 * link.latency_s) if p > 1 else 0.0,  # the push and its reply
        )
    step = sum(phases.values())
    bound = "worker"
    # rank 0's host also answers every other worker's refills (one lock, one GIL): once that and its
    # own messages take longer than a step, the leases run dry and every worker waits for them
    rank0 = k * (messages + (t.pushers - 1) * refill) * costs.rpc_overhead_s
    if rank0 > step:
        phases["coordinator_wait"] = rank0 - step
        step, bound = rank0, "coordinator"
    return Prediction(step, phases, t.sent_bytes, t.link_bytes, t.nic_bytes, messages, bound,
                      inter_sent_bytes=t.inter_sent_bytes)  # fmt: skip


def _pipeline(costs: Costs, world: int, work: Workload) -> Prediction:
    stages = work.stages
    if world % stages:
        raise ValueError(f"pipeline: P={world} is not a multiple of K={stages} stages")
    replicas = world // stages
    m = work.microbatches
    chunk = work.stage_compute_s if work.stage_compute_s is not None else costs.compute_s / m
    per_stage = work.stage_seconds or (chunk,) * stages
    if len(per_stage) != stages:
        raise ValueError(f"pipeline: found {len(per_stage)} stage_seconds for K={stages} stages: expected one each")
    # the runtime's per-chunk work (chunk_overhead_s) includes posting and waiting for its transfers;
    # what remains of a hop is the receiver's side (hop_s: its wake-up) and, across nodes, the wire
    over, share = costs.chunk_overhead_s, work.backward_share
    fwd = [(1 - share) * c + over for c in per_stage]
    bwd = [share * c + over for c in per_stage]
    nodes = math.ceil(world / costs.local_size)

    def hop(busy: int) -> float:
        return costs.hop(busy, costs.intra, work.activation_bytes)

    # process replica x K + stage (the strategy's (dp, pp) mesh) on node process // L; a message
    # between nodes holds both nodes' links for its bytes, one message at a time per direction
    wire: dict[str, Any] = {}
    if nodes > 1:
        # the hop already pays a message's host cost (the in-node link's latency): the wire adds the rest
        wire = {"node_of": lambda process: process // costs.local_size,
                "cross_latency_s": max(0.0, costs.inter.latency_s - costs.intra.latency_s),
                "cross_transfer_s": work.activation_bytes / costs.inter.bandwidth}  # fmt: skip
    run = partial(pipeline_makespan, stages, m, replicas=replicas, schedule=work.schedule)
    span = run(fwd, bwd, hop=hop, cores=costs.cores, **wire)
    alone = run(fwd, bwd)
    bare = run([f - over for f in fwd], [b - over for b in bwd])
    # the span cut into parts: the schedule's critical path of compute, the runtime's work on it,
    # and what the hops, the links and the shared cores add
    phases = {"compute": bare, "chunk_overhead": alone - bare, "transfer_and_contention": span - alone}
    if replicas > 1:  # each stage's gradient reduced over the replicas holding that stage
        sub = costs.with_(local_size=max(1, costs.local_size // stages))
        buckets = costs.buckets(work.grad_bytes / stages)
        latency, bandwidth, reduce = _ring(
            sub, replicas, buckets, segment=costs.gloo_segment_bytes, overhead=0.0, rings=stages
        )
        kr = contention(world, costs.cores)
        phases["allreduce"] = kr * (latency + bandwidth + reduce)
    act = 2 * m * work.activation_bytes  # forward activations and backward gradients
    dp = 2 * (replicas - 1) / replicas * work.grad_bytes / stages if replicas > 1 else 0.0
    nodes = math.ceil(world / costs.local_size)
    nic = stages * dp if nodes > 1 and replicas > costs.local_size // stages else 0.0  # each stage's ring leaves once
    return Prediction(sum(phases.values()), phases, act + dp, max(act, nic, dp), nic, 2 * m)


def _tensor(costs: Costs, world: int, work: Workload) -> Prediction:
    group = work.tensor_size or world
    if world % group:
        raise ValueError(f"tensor: P={world} is not a multiple of T={group} processes per group")
    replicas, share = world // group, work.tensor_split_share
    link = costs.intra if group <= costs.local_size else costs.inter
    rate = link.bandwidth * (costs.ring_share if group > costs.local_size else 1.0)
    latency = bandwidth = reduce = 0.0
    for x in work.tensor_collectives if group > 1 else ():
        chunk = x / group
        latency += 2 * (group - 1) * _segments(chunk, costs.gloo_segment_bytes) * link.latency_s
        bandwidth += 2 * (group - 1) * chunk / rate
        reduce += (group - 1) * chunk * costs.reduce_s_per_byte
    k = contention(world, costs.cores)
    phases = {
        "compute": k * costs.compute_s * (share + group * (1 - share)),
        "latency": k * latency,
        "bandwidth": costs.wire(world) * bandwidth,
        "reduce": k * reduce,
    }
    if work.tensor_layers and costs.tensor_layer_s:  # DTensor's dispatch, every split layer
        phases["dispatch"] = k * work.tensor_layers * costs.tensor_layer_s
    whole = (1 - share) * work.grad_bytes if work.tensor_replicated_bytes is None else work.tensor_replicated_bytes
    sharded = (work.grad_bytes - whole) / group  # a rank's shards, averaged over the replicas holding them
    dp = 0.0
    if replicas > 1:
        sub = costs.with_(local_size=max(1, costs.local_size // group))
        lat, bw, red = _ring(sub, replicas, costs.buckets(sharded), segment=costs.gloo_segment_bytes, overhead=0.0,
                             rings=group)  # fmt: skip
        phases["allreduce"] = k * (lat + bw + red)
        dp = 2 * (replicas - 1) / replicas * sharded
    if whole > 0 and world > 1:  # the whole gradients over every process (TensorParallelStrategy._average_gradients)
        lat, bw, red = _ring(costs, world, costs.buckets(whole), segment=costs.gloo_segment_bytes, overhead=0.0)
        phases["replicated"] = k * (lat + red) + costs.wire(world) * bw
        dp += 2 * (world - 1) / world * whole
    act = sum(2 * (group - 1) / group * x for x in work.tensor_collectives) if group > 1 else 0.0
    nodes = math.ceil(world / costs.local_size)
    nic = act if group > costs.local_size else (group * dp if nodes > 1 else 0.0)
    messages = 2 * (group - 1) * len(work.tensor_collectives) if group > 1 else 0
    messages += 2 * (world - 1) * len(costs.buckets(whole)) if whole > 0 and world > 1 else 0
    return Prediction(sum(phases.values()), phases, act + dp, max(act, dp), nic, messages, inter_sent_bytes=nic)


def predict(strategy: str, costs: Costs, world: int, work: Workload) -> Prediction:
    """The step of ``strategy`` (one of :data:`STRATEGIES`) at ``world`` processes, the training loop's
    phase included (:func:`~lightning_strategies.advisor.costs.with_loop`)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, found {world}")
    priced: dict[str, Callable[[Costs, int, Workload], Prediction]] = {
        "ddp": partial(_flat_ring, "ddp"), "ring": partial(_flat_ring, "ring"),
        "ring_bf16": partial(_flat_ring, "ring_bf16"), "ring_hier": _hier_ring, "ps": _ps,
        "ps_flat": partial(_ps, hierarchical=False), "ps_1": _ps_1, "ps_ring": _ps_ring, "async": _async,
        "pipeline": _pipeline,
        "tensor": _tensor}  # fmt: skip
    if strategy not in priced:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {list(STRATEGIES)}")
    return with_loop(priced[strategy](costs, world, work), costs, world, work)
