"""The cluster a prediction is for, and its presets (``conf/cluster/*.yaml``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_strategies.advisor.costs import Costs, Link

__all__ = ["PRESETS_DIR", "Cluster", "load_cluster", "preset_names"]

#: where the presets live in a checkout (the Hydra app's ``cluster`` group)
PRESETS_DIR = Path(__file__).resolve().parents[2] / "conf" / "cluster"
_GIB = 1 << 30


@dataclass(frozen=True)
class Cluster:
    """Nodes of processes (one device each) and the links between them.

    Args:
        nodes: machines.
        per_node: processes (devices) per machine.
        intra_gbps: Gb/s one process sends to another inside a node (one direction).
        inter_gbps: Gb/s a node's network link carries (one direction; its processes share it).
        latency_us: one small message between two nodes; on CPU (gloo) the wire's alone (half a ping:
            a message also pays the host's per-message cost, ``intra_latency_us``), on GPUs the whole
            message (NCCL's proxy included).
        device_memory_gib: memory one process may hold (a GPU's; a CPU process's share of RAM).
        name: what the preset is called.
        intra_latency_us: one message inside a node, where the wire costs nothing (on CPU: gloo's
            software and the receiver's wake-up, what every message pays); ``None``: ``latency_us``.
        device: ``"cpu"`` (gloo: 1 MiB segments, processes share ``cores``) or a GPU's name
            (NCCL: one message per ring step, a device each).
        cores: cores the processes share (CPU); ``None``: a device each.
        tflops: sustained throughput of one device, for compute time from counted FLOPs;
            ``None``: time the model on this machine.
        rpc_overhead_us: host work of one RPC message (ps, async).
        ring_overhead_us: host work of one ``comm.ring`` message on top of the link's.
        chunk_overhead_us: the pipeline runtime's work per micro-batch chunk.
        tensor_overhead_us: the tensor strategy's host work per split layer and step (DTensor's dispatch).
        ps_overhead_us_per_tensor: a ps worker's and shard's Python work per tensor and step.
        wake_us: a pipeline hop's latency at the receiver (its wake-up) while 0, 1, ... other
            processes are busy (measured: ``benchmarks/scale.py``'s ``calib_wake_us_busy<b>``); ``()``:
            the in-node link's latency and bytes.
        ft_protocol_us: a torchft sync's quorum and commit besides its all-reduce (``ft``,
            ``local_sgd``, ``diloco``).
        all_to_all_share: each direction's goodput of a node's link while the flat ps / async exchange
            runs (every process pushing to every shard on other nodes at once, and answering theirs), over
            one stream's (``inter_gbps``); 1: as one stream. Measured by ``benchmarks/cluster_exchange.py``.
        ring_share: each direction's goodput of a node's link under a ring all-reduce between nodes (gloo's
            steps, its messages' latency taken out), over one stream's; 1: as one stream. From
            ``benchmarks/cluster_exchange.py``'s bare all-reduce.
        hier_push_share: the same under ps's hierarchical push between nodes (one flow per local rank and
            remote node each way: a push, a barrier, a pull). From ``benchmarks/cluster_exchange.py``'s
            ``hier_push``.
        loop_us: the training loop's host work per step and process besides forward, backward and the
            optimizer's arithmetic (Lightning's hooks and closure, the batch's fetch); 0: not charged.
            Measured by ``benchmarks/loop_overhead.py``.
    """

    nodes: int
    per_node: int
    intra_gbps: float
    inter_gbps: float
    latency_us: float
    device_memory_gib: float
    name: str = "custom"
    intra_latency_us: float | None = None
    device: str = "cpu"
    cores: float | None = None
    tflops: float | None = None
    rpc_overhead_us: float = 0.0
    ring_overhead_us: float = 0.0
    chunk_overhead_us: float = 0.0
    tensor_overhead_us: float = 0.0
    ps_overhead_us_per_tensor: float = 0.0
    wake_us: tuple[float, ...] = ()
    ft_protocol_us: float = 0.0
    all_to_all_share: float = 1.0
    ring_share: float = 1.0
    hier_push_share: float = 1.0
    loop_us: float = 0.0

    def __post_init__(self) -> None:
        for key in ("nodes", "per_node"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(
                    f"Cluster {self.name!r}: found {key}={getattr(self, key)!r}: expected an integer "
                    f">= 1. Fix: set {key} to the number of machines / processes per machine"
                )
        for key in ("intra_gbps", "inter_gbps", "device_memory_gib"):
            if not getattr(self, key) > 0:
                raise ValueError(
                    f"Cluster {self.name!r}: found {key}={getattr(self, key)!r}: expected a positive "
                    f"number. Fix: state the link's rate in Gb/s and the device's memory in GiB"
                )
        if self.loop_us < 0:
            raise ValueError(
                f"Cluster {self.name!r}: found loop_us={self.loop_us}: expected >= 0 (the training loop's host "
                "work per step). Fix: measure it (benchmarks/loop_overhead.py) or leave it at 0"
            )
        if self.latency_us < 0 or (self.tflops is not None and not self.tflops > 0):
            raise ValueError(
                f"Cluster {self.name!r}: found latency_us={self.latency_us}, tflops={self.tflops}: "
                "expected latency >= 0 and tflops > 0 (or null). Fix: correct the preset"
            )
        for key in ("all_to_all_share", "ring_share", "hier_push_share"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(
                    f"Cluster {self.name!r}: found {key}={getattr(self, key)}: expected a share of one stream's "
                    "goodput in (0, 1]. Fix: measure it (benchmarks/cluster_exchange.py) or leave it at 1"
                )

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def memory_bytes(self) -> float:
        return self.device_memory_gib * _GIB

    @property
    def gpu(self) -> bool:
        return self.device != "cpu"

    def costs(self, compute_s: float) -> Costs:
        """The scale model's constants for a worker step of ``compute_s`` on one device."""
        intra_lat = self.latency_us if self.intra_latency_us is None else self.intra_latency_us
        intra = Link(intra_lat * 1e-6, self.intra_gbps * 1e9 / 8)
        # on CPU a message between nodes is a message inside one (gloo's software, the wake-up) plus the wire
        host = 0.0 if self.gpu or self.intra_latency_us is None else self.intra_latency_us
        inter = Link((self.latency_us + host) * 1e-6, self.inter_gbps * 1e9 / 8)
        segment = math.inf if self.gpu else float(1 << 20)  # NCCL: a message per step; gloo: 1 MiB pieces
        per_tensor = self.ps_overhead_us_per_tensor * 1e-6 / 3
        return Costs(
            compute_s=compute_s,
            local_size=self.per_node,
            intra=intra,
            inter=inter,
            inter_shared=True,  # one link per node: the flows leaving a node at once share it
            ring_overhead_s=self.ring_overhead_us * 1e-6,
            gloo_segment_bytes=segment,
            ring_segment_bytes=math.inf if self.gpu else float(4 << 20),
            rpc_overhead_s=self.rpc_overhead_us * 1e-6,
            rpc_intra=intra,
            rpc_inter=inter,
            ps_client_s_per_tensor=per_tensor,
            ps_average_s_per_tensor=per_tensor,
            ps_update_s_per_tensor=per_tensor,
            chunk_overhead_s=self.chunk_overhead_us * 1e-6,
            tensor_layer_s=self.tensor_overhead_us * 1e-6,
            cores=self.cores,
            cpu_links=self.nodes == 1,  # between nodes a network's wire, not memory copies
            min_chunk_bytes=float(256 << 10),  # comm.ring.MIN_CHUNK_BYTES
            hop_s=tuple(w * 1e-6 for w in self.wake_us),
            ft_protocol_s=self.ft_protocol_us * 1e-6,
            all_to_all_share=self.all_to_all_share,
            ring_share=self.ring_share,
            hier_push_share=self.hier_push_share,
            node_all_reduce=not self.gpu,  # comm.ps.hierarchy: on gloo the node all-reduces the whole buffer
            loop_s=self.loop_us * 1e-6,
        )

    def with_(self, **changes: Any) -> Cluster:
        return dataclasses.replace(self, **changes)


def preset_names(directory: Path = PRESETS_DIR) -> list[str]:
    """The presets found in ``directory``."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_cluster(preset: str | Path, **changes: Any) -> Cluster:
    """A :class:`Cluster` from a preset name (``conf/cluster/<name>.yaml``) or a YAML file.

    Raises:
        ValueError: for an unknown preset (naming the known ones) or a key ``Cluster`` does not take.
    """
    import yaml

    path = Path(preset)
    if not path.suffix:
        path = PRESETS_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ValueError(
            f"cluster {str(preset)!r}: found no file {path}: expected a preset, one of "
            f"{', '.join(preset_names()) or '(none found)'}, or a YAML file. Fix: name one of them"
        )
    data = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if not str(k).startswith("_")}
    data.setdefault("name", path.stem)
    known = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"cluster {path}: found keys {unknown}: expected some of {sorted(known)}. Fix: remove or rename them"
        )
    if "wake_us" in data:  # a YAML list
        data["wake_us"] = tuple(data["wake_us"])
    return Cluster(**{**data, **changes})
