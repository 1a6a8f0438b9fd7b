"""The scale model's inputs and output: a machine's or cluster's constants (:class:`Costs`), one step's
work (:class:`Workload`) and a strategy's predicted step (:class:`Prediction`).

Pure data (no torch); :mod:`lightning_strategies.advisor.model` prices the strategies with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = ["MIB", "Costs", "Link", "Prediction", "Workload", "contention", "ddp_buckets", "with_loop"]

MIB = 1 << 20


@dataclass(frozen=True)
class Link:
    """One direction of a link: ``messages x latency_s + nbytes / bandwidth`` seconds."""

    latency_s: float
    bandwidth: float  # bytes per second

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Costs:
    """The measured (or stated) constants of a machine or a cluster.

    Attributes:
        compute_s: forward + backward of one worker's step on its own device (or core), alone.
        local_size: processes per node (L).
        intra: the collective backend's link inside a node; ``latency_s`` per message of its own
            all-reduce (gloo's C++ segments; NCCL's hop).
        inter: the same between nodes.
        inter_shared: the inter-node bandwidth is the node's (one NIC shared by the flows that
            leave the node at once) rather than each flow's.
        ring_overhead_s: what a message of ``comm.ring`` (a Python send/recv, its loop per segment,
            the call's own work) costs on top of the backend's own messages.
        gloo_segment_bytes: segment of the backend's ring (gloo: 1 MiB; NCCL on GPUs: its chunks,
            modelled as one message per step: ``math.inf``).
        ring_segment_bytes: segment of ``comm.ring`` (4 MiB on gloo; one message per step on NCCL).
        reduce_s_per_byte: adding a received chunk into the local one, per byte.
        rpc_overhead_s: host work of one RPC message (TensorPipe, the Python handler), per message
            (the formula path: the cluster's projection).
        rpc_intra: an RPC payload's wire inside a node (latency: the wire's alone).
        rpc_inter: the same between nodes.
        ps_client_s_per_byte: a ps worker packing its gradients and copying the pulled values back,
            per gradient byte.
        ps_average_s_per_byte: a shard averaging one worker's gradient (divide, add), per byte.
        ps_update_s_per_byte: a shard's optimizer step and reply packing, per byte it holds.
        ps_client_s_per_tensor, ps_average_s_per_tensor, ps_update_s_per_tensor: the same per
            tensor (the Python loops over the model's tensors, whatever their size).
        rpc_exchange_s: measured transport of a ps / async step: every rank echoes D/P off every other
            rank at once (push and reply, P-1 peers each); ``None``: the links' formula.
        rpc_gather_s: measured transport of a ps_1 step: P-1 ranks echo D off rank 0 at once;
            ``None``: the formula.
        ps_protocol_s: what ps's protocol adds per remote peer and step on top of its transport and
            host work (the barrier's future, the RPC threads' hand-offs); with a measured transport.
        chunk_overhead_s: the pipeline runtime's host work per micro-batch chunk (forward or backward).
        tensor_layer_s: the tensor strategy's host work per split layer and step besides its compute and
            its collectives (DTensor's dispatch of the layer's forward, backward and optimizer step).
        hop_s: latency of a pipeline hop (an activation's ``isend`` to the next stage) when b = 0, 1, ...
            processes other than the receiver are busy (the last entry for more), measured at the
            run's activation size; ``()``: the link's latency and bandwidth.
        cores: cores the processes effectively share (contention); ``None``: one device each.
        bucket_bytes: DDP's bucket cap (``bucket_cap_mb``, 25 MiB).
        first_bucket_bytes: DDP's first, smaller bucket (1 MiB).
        min_chunk_bytes: the ring strategy's smallest chunk per step (``comm.ring.MIN_CHUNK_BYTES``,
            256 KiB): its buckets grow to P x this once that exceeds ``bucket_bytes``; 0: fixed buckets.
        overlap_s: seconds of the all-reduce (ddp, ring, ring_hier) hidden under the backward pass;
            0: compute, then communicate (what the validation runs do).
        async_lease: batches an async worker leases at a time (``comm.async_.lease.DEFAULT_LEASE``).
        cpu_links: the links' bandwidth is CPU work (loopback copies) and slows with contention;
            ``False``: a network's, which does not.
        ft_protocol_s: a torchft sync's protocol besides its all-reduce (the quorum's round trip
            through the Lighthouse, the Manager's ``should_commit``): ``ft`` pays it every step,
            ``local_sgd`` / ``diloco`` once per sync.
        duplex_share: each direction's goodput between nodes while both directions of a node's link
            carry data at once, over one direction's alone. ``inter`` and ``rpc_inter`` are the duplex
            figure (a ring, the sharded servers, tensor's all-reduces and the pipeline's 1F1B send and
            receive at once); ps_1's server receives every push, then sends every reply, one direction
            at a time, at ``bandwidth / duplex_share``. 1: full duplex (a preset without a probe).
        all_to_all_share: the flat ps / async exchange's goodput per direction of a node's link (every
            process pushing to and answering every shard on other nodes at once: many flows through the
            link's queue) over ``rpc_inter``'s; 1: as one stream each way.
        hier_push_share: the hierarchical ps / async exchange's goodput per direction of a node's link (one
            flow per local rank and remote node each way, push, barrier, pull) over ``rpc_inter``'s; 1: as
            one stream each way.
        node_all_reduce: the hierarchical push sums a node's gradients with an all-reduce of the whole buffer
            (gloo, whose reduce-scatter is slower) rather than a reduce-scatter (NCCL): 2(L-1) steps, not L-1.
        ring_share: a ring all-reduce's goodput per direction of a node's link (its step-by-step sends and
            receives, less the messages' latency, which ``inter.latency_s`` charges) over ``inter``'s; 1: as
            one stream each way.
        loop_s: the training loop's host work per step and process besides forward, backward and the
            optimizer's arithmetic (Lightning's hooks and closure, the next batch's fetch, the optimizer
            call's Python); every strategy pays it, with the processes' contention; 0: not charged.
    """

    compute_s: float
    local_size: int
    intra: Link
    inter: Link
    inter_shared: bool = False
    ring_overhead_s: float = 0.0
    gloo_segment_bytes: float = MIB
    ring_segment_bytes: float = 4 * MIB
    reduce_s_per_byte: float = 0.0
    rpc_overhead_s: float = 0.0
    rpc_intra: Link = field(default_factory=lambda: Link(0.0, math.inf))
    rpc_inter: Link = field(default_factory=lambda: Link(0.0, math.inf))
    ps_client_s_per_byte: float = 0.0
    ps_average_s_per_byte: float = 0.0
    ps_update_s_per_byte: float = 0.0
    ps_client_s_per_tensor: float = 0.0
    ps_average_s_per_tensor: float = 0.0
    ps_update_s_per_tensor: float = 0.0
    rpc_exchange_s: float | None = None
    rpc_gather_s: float | None = None
    ps_protocol_s: float = 0.0
    chunk_overhead_s: float = 0.0
    tensor_layer_s: float = 0.0
    hop_s: tuple[float, ...] = ()
    cores: float | None = None
    bucket_bytes: float = 25 * MIB
    first_bucket_bytes: float = MIB
    min_chunk_bytes: float = 0.0
    overlap_s: float = 0.0
    async_lease: int = 4
    cpu_links: bool = True
    ft_protocol_s: float = 0.0
    duplex_share: float = 1.0
    all_to_all_share: float = 1.0
    ring_share: float = 1.0
    hier_push_share: float = 1.0
    node_all_reduce: bool = False
    loop_s: float = 0.0

    def wire(self, world: int) -> float:
        """The contention factor of a bandwidth term."""
        return contention(world, self.cores) if self.cpu_links else 1.0

    def buckets(self, grad_bytes: float, world: int = 1, *, grow: bool = False) -> list[float]:
        """DDP's buckets of ``grad_bytes``; with ``grow``, the ring strategy's (at least P x min chunk)."""
        cap = max(self.bucket_bytes, world * self.min_chunk_bytes) if grow else self.bucket_bytes
        return ddp_buckets(grad_bytes, cap, self.first_bucket_bytes)

    def with_(self, **changes: object) -> Costs:
        return replace(self, **changes)  # type: ignore[arg-type]

    def hop(self, busy: int, link: Link, nbytes: float = 0.0) -> float:
        """A message of ``nbytes`` to a waiting process while ``busy`` others compute: the measured
        hop of that busy count (at the run's message size: its bytes included), else the link's."""
        if self.hop_s:
            return self.hop_s[min(busy, len(self.hop_s) - 1)]
        return link.latency_s + nbytes / link.bandwidth


@dataclass(frozen=True)
class Workload:
    """What one step moves and computes.

    Attributes:
        grad_bytes: D, the gradient (= parameter) bytes every data-parallel worker reduces.
        tensors: the model's trainable tensors (ps and async loop over them; 161 in ResNet-50).
        stages: pipeline stages K (the pipeline strategy only).
        microbatches: pipeline micro-batches M per step.
        activation_bytes: one micro-batch's activation at a stage boundary (its gradient comes
            back the same size).
        stage_compute_s: forward + backward of one stage on one micro-batch; ``None``: the
            worker's ``compute_s / microbatches`` (each stage does 1/K of the model for K times the
            batch, as much work per device as a data-parallel worker).
        backward_share: the backward's share of ``stage_compute_s`` (2/3: a backward computes the
            gradients of the inputs and of the weights, each a forward's work).
        tensor_size: tensor-parallel group T (the tensor strategy only); 0: the whole world.
        tensor_collectives: bytes of each activation all-reduce of a tensor-parallel step (forward
            and backward, at the group's batch).
        tensor_split_share: the share of compute and of gradient bytes in the split layers.
        tensor_layers: the layers the plan splits (``Costs.tensor_layer_s`` each).
        tensor_replicated_bytes: gradient bytes left whole on every rank of a group (the unsplit layers,
            a row-split layer's bias), all-reduced over every process each step; ``None``: the unsplit
            layers' share, ``(1 - tensor_split_share) x grad_bytes``.
        schedule: the pipeline's schedule, ``gpipe`` or ``1f1b``
            (:func:`~lightning_strategies.advisor.schedule.pipeline_order`).
        stage_seconds: forward + backward of each stage on one micro-batch (stages differ); ``()``:
            every stage ``stage_compute_s``.
        optimizer_s: the optimizer step on one process's parameters (a pipeline stage's, a tensor rank's
            shards and whole tensors; 0 under ps and async, whose shards' update ``Costs.ps_update_s_per_*``
            charges).
    """

    grad_bytes: float
    tensors: int = 1
    stages: int = 2
    microbatches: int = 4
    activation_bytes: float = 0.0
    stage_compute_s: float | None = None
    backward_share: float = 2 / 3
    tensor_size: int = 0
    tensor_collectives: tuple[float, ...] = ()
    tensor_split_share: float = 1.0
    tensor_layers: int = 0
    tensor_replicated_bytes: float | None = None
    schedule: str = "gpipe"
    stage_seconds: tuple[float, ...] = ()
    optimizer_s: float = 0.0


@dataclass
class Prediction:
    """A strategy's step at P processes.

    Attributes:
        step_s: seconds per step (for ``async``: per worker step, workers not in lockstep).
        phases: seconds of each part of the step, contention included; they add up to ``step_s``
            (for ``async``, ``bound`` says which resource sets the pace).
        busiest_sent_bytes: bytes the busiest process sends per step, every link together.
        link_bytes: bytes on the busiest single link (one direction) per step.
        nic_bytes: bytes leaving the busiest node per step (0 on one node).
        messages: messages the busiest process sends per step.
        bound: what sets the pace when it is not the worker's own step (``async``: ``"coordinator"``).
        inter_sent_bytes: bytes the busiest process sends to other nodes per step.
    """

    step_s: float
    phases: dict[str, float]
    busiest_sent_bytes: float
    link_bytes: float
    nic_bytes: float
    messages: float
    bound: str = ""
    inter_sent_bytes: float = 0.0


def contention(busy: float, cores: float | None) -> float:
    """How much longer CPU-bound work takes when ``busy`` processes share ``cores`` cores."""
    if cores is None or busy <= 0:
        return 1.0
    return max(1.0, busy / cores)


def ddp_buckets(grad_bytes: float, cap: float = 25 * MIB, first: float = MIB) -> list[float]:
    """DDP's gradient buckets: a 1 MiB first bucket (``first``), then ``cap`` each, the rest last."""
    buckets, left = [], float(grad_bytes)
    size = min(first, cap)
    while left > 0:
        buckets.append(min(size, left))
        left -= buckets[-1]
        size = cap
    return buckets


def with_loop(pred: Prediction, costs: Costs, world: int, work: Workload) -> Prediction:
    """``pred`` with the training loop's phase added (``loop``: each process's ``Costs.loop_s`` and its
    optimizer step, ``Workload.optimizer_s``, under the processes' contention), when there is any."""
    loop = contention(world, costs.cores) * (costs.loop_s + work.optimizer_s)
    if loop <= 0:
        return pred
    return replace(pred, step_s=pred.step_s + loop, phases={**pred.phases, "loop": loop})
