"""The scale model on the emulated cluster: a step is compute plus the busiest NIC's bytes over the link.

Pure arithmetic (no torch), so ``tests/unit/test_scale_model_calibration.py`` holds it to hand-computed values.

On the emulated cluster (``benchmarks/emulated``) every node's link is shaped to a rate R in both
directions by HTB; inside a node, processes talk at loopback speed. A strategy's step there is

    step(R) = compute + nic_bytes / goodput(R) + messages x latency

- ``nic_bytes``: the bytes through the busiest node's link per step, in its busier direction (the
  link is full-duplex and each direction is shaped on its own): D times the formula of
  ``benchmarks/cluster_strategies.formula_over_d`` for the data-parallel strategies; for the
  pipeline and tensor parallelism (activations, whose volume depends on the cut, not on R) the
  bytes measured at the calibration rate;
  A link is full-duplex: where a step uses both directions at once (the rings, sharded ps, whose
  every node pushes and serves at the same time) its time is the busier direction's; one server
  (``ps1``) first receives every push, then, after its update, sends every pull: its node's two
  directions are used one after the other, so its critical bytes are both directions' sum
  (:func:`serial_directions`: 2 x the one-way formula);
- ``goodput(R)``: the payload a TCP stream moves per second through the shaped link, measured (a
  stream between two nodes): R less the headers;
- ``latency``: one small message's one-way time between two nodes, measured (a ping-pong), times the
  messages on the step's critical path that cross a link (:func:`critical_messages`);
- ``compute``: everything else (forward, backward, the framework's host work, the intra-node
  exchanges), per (strategy, layout), calibrated from the run at the fastest rate:
  ``compute = measured(R_fast) - nic_bytes / goodput(R_fast) - messages x latency``.

So the model has no free parameter per rate: the slower rates are predictions. Where the
communication term is at least half the predicted step the cell is ``comm_bound`` (the cells the
model's error is judged on).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClusterCell", "calibrate_compute", "comm_seconds", "critical_messages", "predict_step", "serial_directions"]


@dataclass(frozen=True)
class ClusterCell:
    """One prediction: a strategy on a layout at a rate.

    Attributes:
        compute_s: the calibrated compute term.
        comm_s: the link term (bytes over goodput plus the messages' latency).
    """

    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_bound(self) -> bool:
        """Whether communication is at least half the step."""
        return self.comm_s >= 0.5 * self.step_s


def critical_messages(strategy: str, nodes: int, per_node: int) -> int:
    """Messages across a link on a step's critical path (each costs one latency), per strategy.

    A flat ring and gloo's (ddp): 2(P-1) steps, each with a hop that crosses a node boundary; the
    hierarchical ring: 2(N-1) steps across nodes; ps and async: a push and its reply; one server:
    the same (its replies go out at once); the pipeline: one activation and one gradient per
    node boundary and micro-batch wave (2(N-1)); tensor parallelism: one all-reduce of gloo's ring
    per split layer pair forward and backward, 2(P-1) steps each (counted as 2 pairs).
    """
    p = nodes * per_node
    table = {
        "ddp": 2 * (p - 1),
        "ring": 2 * (p - 1),
        "ring_bf16": 2 * (p - 1),
        "ring_hier": 2 * (nodes - 1),
        "ps": 2,
        "ps1": 2,
        "async": 2,
        "pipeline": 2 * (nodes - 1),
        "tensor": 2 * 2 * 2 * (p - 1),
    }
    if strategy not in table:
        raise ValueError(f"strategy {strategy!r}: found no message count: expected one of {sorted(table)}. "
                         "Fix: add its count to critical_messages")  # fmt: skip
    return table[strategy]


def serial_directions(strategy: str) -> int:
    """How many times the busier direction's bytes lie on the step's critical path: 2 for one
    server (push in, then pull out), 1 where both directions carry traffic at once."""
    return 2 if strategy == "ps1" else 1


def comm_seconds(nic_bytes: float, goodput: float, messages: int, latency_s: float) -> float:
    """``nic_bytes / goodput + messages x latency_s`` (goodput in bytes per second)."""
    if not goodput > 0:
        raise ValueError(f"found goodput {goodput!r} B/s: expected a positive rate. Fix: measure the link first")
    return nic_bytes / goodput + messages * latency_s


def calibrate_compute(measured_fast_s: float, comm_fast_s: float) -> float:
    """The compute term from the run at the fastest rate: measured less its link term, at least 0."""
    return max(0.0, measured_fast_s - comm_fast_s)


def predict_step(compute_s: float, nic_bytes: float, goodput: float, messages: int, latency_s: float) -> ClusterCell:
    """The predicted step at a rate whose payload goodput is ``goodput`` bytes per second."""
    return ClusterCell(compute_s, comm_seconds(nic_bytes, goodput, messages, latency_s))
