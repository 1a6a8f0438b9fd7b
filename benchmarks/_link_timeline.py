"""When a node's link carries bytes within a step (``cluster_strategies.py --link-sample-ms``; #28).

On the emulated 2 x 2 cluster ps moves a ring's bytes through each node's link (``node_nic_bytes``) yet
took 1.15-1.33 x ring_hier's step, and its bare transport pattern (``cluster_exchange.py``'s
``hier_push``) did not account for the gap. This looks inside the step: each fit
(``benchmarks/emulated/_fit.py --link-sample-ms``) has every node's local rank 0 read its link's byte
counters every few milliseconds over the timed steps, next to its step starts and, under ps, the
overlapped push's timestamps (``StepTimeline``: the first in-node reduce, the first push, backward's
end, each shard's reply arriving, the values landing, the next forward).

A sample interval is *busy* in a direction when that direction moved at least half the shaped rate
in it, and the link is *silent* when both directions moved under 5% of it. Lines (``name value unit``;
medians over the timed steps, then the nodes' mean, then the rounds' median):

    link_util_<strategy>_<layout>_<rate>              the bytes moved over what the rate allows in the window
                                                      (both directions' mean)
    link_busy_share_<strategy>_<layout>_<rate>        the share of the window a direction was busy (mean)
    link_silent_ms_per_step_<strategy>_<layout>_<rate>  ms per step in which neither direction carried bytes
    link_one_way_ms_per_step_<strategy>_<layout>_<rate> ms per step in which exactly one direction was busy
    link_step_ms_<strategy>_<layout>_<rate>           the step's wall ms (step start to next step start)
    link_event_ms_<event>_<strategy>_<layout>_<rate>  ps: the event's time after the step's start (node 0's
                                                      local rank 0), events: first_node_reduce, first_push,
                                                      backward_end, first_reply, last_reply, last_landed,
                                                      next_forward

and, per strategy, one timed step of node 0 as segments (``# ... silent 0-12, tx 12-340, both ...``), and
:func:`plot` draws node 0's two directions over the timed steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import median, pyplot, save_figure
from benchmarks.emulated.cluster import parse_rate

BUSY, SILENT = 0.5, 0.05  # of the shaped rate, per interval
GSO_PACKETS = 4  # an interval's least length: this many 64 KiB packets' time at the rate
EVENTS = ("first_node_reduce", "first_push", "backward_end", "first_reply", "last_reply", "last_landed",
          "next_forward")  # fmt: skip


def rates(samples: Sequence[Sequence[float]], rate: float) -> list[tuple[float, float, float, float]]:
    """``(start, end, tx B/s, rx B/s)`` per interval of consecutive samples, each interval at least
    :data:`GSO_PACKETS` GSO packets' time at ``rate`` (B/s) long: the veth counts a GSO packet (up to 64 KiB)
    at once, 10 ms at 50 Mbit/s, so a shorter interval sees a busy link flicker between full and idle."""
    span = GSO_PACKETS * 65536 / rate
    out = []
    t0, tx0, rx0 = samples[0] if samples else (0.0, 0.0, 0.0)
    for t1, tx1, rx1 in samples[1:]:
        if t1 - t0 >= span:
            out.append((t0, t1, (tx1 - tx0) / (t1 - t0), (rx1 - rx0) / (t1 - t0)))
            t0, tx0, rx0 = t1, tx1, rx1
    return out


def state(tx: float, rx: float, rate: float) -> str:
    """An interval's state: ``both`` / ``tx`` / ``rx`` busy, ``silent``, or ``low`` (some bytes, neither busy)."""
    busy_tx, busy_rx = tx >= BUSY * rate, rx >= BUSY * rate
    if busy_tx and busy_rx:
        return "both"
    if busy_tx or busy_rx:
        return "tx" if busy_tx else "rx"
    return "silent" if tx < SILENT * rate and rx < SILENT * rate else "low"


def step_bounds(record: dict[str, Any]) -> list[tuple[float, float]]:
    """The timed steps' ``(start, next start)`` of a rank: every timed step but the last (whose end, under ps,
    is the fit's wait for its last replies, no step's)."""
    starts = [p["t0"] for p in record["phases"][record["warmup"] :]]
    return list(itertools.pairwise(starts))


def segments(intervals: Sequence[tuple[float, float, float, float]], t0: float, t1: float, rate: float) -> list[
        tuple[float, float, str]]:  # fmt: skip
    """Consecutive intervals of one state within ``[t0, t1)`` merged: ``(start ms, end ms, state)`` from ``t0``."""
    out: list[tuple[float, float, str]] = []
    for a, b, tx, rx in intervals:
        if b <= t0 or a >= t1:
            continue
        s, lo, hi = state(tx, rx, rate), 1e3 * (max(a, t0) - t0), 1e3 * (min(b, t1) - t0)
        if out and out[-1][2] == s:
            out[-1] = (out[-1][0], hi, s)
        else:
            out.append((lo, hi, s))
    return out


def ps_events(record: dict[str, Any], t0: float, t1: float) -> dict[str, float]:
    """The overlapped push's timestamps of the step starting at ``t0`` (its pushes went out before ``t1``), in
    ms after ``t0``; its replies and landing may fall in the next step."""
    for t in record.get("push_timeline", []):
        if t.get("first_push") is not None and t0 <= t["first_push"] < t1:
            arrived, landed = list(t["pull_arrived"].values()), list(t["pull_landed"].values())
            raw = {"first_node_reduce": t.get("first_node_reduce"), "first_push": t["first_push"],
                   "backward_end": t.get("backward_end"), "first_reply": min(arrived, default=None),
                   "last_reply": max(arrived, default=None), "last_landed": max(landed, default=None),
                   "next_forward": t.get("next_forward")}  # fmt: skip
            return {k: 1e3 * (v - t0) for k, v in raw.items() if v is not None}
    return {}


def tcp_limits(tcp: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """A node's TCP connections to other nodes over the window (``_fit.tcp_counters`` at its start and end),
    summed: ms busy sending, of them limited by the peer's receive window and by the own send buffer."""
    start, end = tcp.get("start", {}), tcp.get("end", {})
    out = {"busy": 0.0, "rwnd_limited": 0.0, "sndbuf_limited": 0.0, "bytes_sent": 0.0}
    for conn, e in end.items():
        s = start.get(conn, {})
        for k in out:
            out[k] += e.get(k, 0.0) - s.get(k, 0.0)
    return out


def analyse(run: dict[str, Any], rate_bits: int) -> dict[str, Any]:
    """One run's figures: per node (its local rank 0's samples and steps), then their mean."""
    rate = rate_bits / 8.0
    nodes = []
    for rec in (r for r in run["records"] if r.get("link_samples")):
        iv = rates(rec["link_samples"], rate)
        window = iv[-1][1] - iv[0][0]
        moved = (rec["link_samples"][-1][1] - rec["link_samples"][0][1]) + (
            rec["link_samples"][-1][2] - rec["link_samples"][0][2])  # fmt: skip
        busy = sum((b - a) * ((tx >= BUSY * rate) + (rx >= BUSY * rate)) for a, b, tx, rx in iv) / 2
        per_step = []
        for t0, t1 in step_bounds(rec):
            seg = segments(iv, t0, t1, rate)
            per_step.append({
                "step_ms": 1e3 * (t1 - t0),
                "silent_ms": sum(b - a for a, b, s in seg if s == "silent"),
                "one_way_ms": sum(b - a for a, b, s in seg if s in ("tx", "rx")),
                "events": ps_events(rec, t0, t1),
                "segments": seg,
            })  # fmt: skip
        nodes.append({"node": rec["node"], "util": moved / (2 * rate * window), "busy": busy / window,
                      "steps": per_step, "tcp": tcp_limits(rec.get("link_tcp", {}))})  # fmt: skip
    if not nodes or not all(n["steps"] for n in nodes):
        raise ValueError(
            f"link timeline: found {len(nodes)} sampled node(s), with {[len(n['steps']) for n in nodes]} whole timed "
            "steps: expected every node's local rank 0 to sample at least 2 timed steps (a step ends where the next "
            "begins). Fix: pass --link-sample-ms > 0 and --steps at least --warmup + 2"
        )
    mean = lambda key: sum(median([s[key] for s in n["steps"]]) for n in nodes) / len(nodes)  # noqa: E731
    out: dict[str, Any] = {
        "util": sum(n["util"] for n in nodes) / len(nodes),
        "busy": sum(n["busy"] for n in nodes) / len(nodes),
        "silent_ms": mean("silent_ms"),
        "one_way_ms": mean("one_way_ms"),
        "step_ms": mean("step_ms"),
        "nodes": nodes,
    }
    tcp_busy = sum(n["tcp"]["busy"] for n in nodes)
    if tcp_busy > 0:
        out["tcp_rwnd"] = sum(n["tcp"]["rwnd_limited"] for n in nodes) / tcp_busy
        out["tcp_sndbuf"] = sum(n["tcp"]["sndbuf_limited"] for n in nodes) / tcp_busy
    node0 = min(nodes, key=lambda n: n["node"])
    out["events"] = {e: median(v) for e in EVENTS if (v := [s["events"][e] for s in node0["steps"] if e in
                                                              s["events"]])}  # fmt: skip
    return out


def describe(tag: str, node: dict[str, Any]) -> str:
    """A comment line: node 0's median-length timed step as its segments (and ps's events)."""
    steps = sorted(node["steps"], key=lambda s: s["step_ms"])
    s = steps[len(steps) // 2]
    seg = ", ".join(f"{st} {a:.0f}-{b:.0f}" for a, b, st in s["segments"] if b - a >= 1.0)
    ev = ", ".join(f"{k} {v:.0f}" for k, v in s["events"].items())
    return f"# {tag} node {node['node']}, a {s['step_ms']:.0f} ms step (ms from its start): {seg}" + (
        f"; ps events: {ev}" if ev else "")  # fmt: skip


def report(runs: dict[str, list[dict[str, Any]]], line: Callable[[str, float, str], str]) -> list[str]:
    """The lines of every run key (``strategy|layout|rate``) whose runs' records hold link samples, through
    ``line(name, value, unit)``, and one comment line per key (:func:`describe`)."""
    out = []
    for key, rs in runs.items():
        sampled = [r for r in rs if any(rec.get("link_samples") for rec in r.get("records", []))]
        if not sampled:
            continue
        a = [analyse(r, parse_rate(key.split("|")[2])) for r in sampled]
        tag = key.replace("|", "_")
        for name, field, unit in (
            ("link_util", "util", "x"),
            ("link_busy_share", "busy", "x"),
            ("link_silent_ms_per_step", "silent_ms", "ms/step"),  # may be 0: not a positive unit
            ("link_one_way_ms_per_step", "one_way_ms", "ms/step"),
            ("link_step_ms", "step_ms", "ms"),
        ):
            out.append(line(f"{name}_{tag}", median([x[field] for x in a]), unit))
        for name, field in (
            ("link_tcp_rwnd_limited_share", "tcp_rwnd"),
            ("link_tcp_sndbuf_limited_share", "tcp_sndbuf"),
        ):
            if all(field in x for x in a):
                out.append(line(f"{name}_{tag}", median([x[field] for x in a]), "frac"))
        for e in EVENTS:
            values = [x["events"][e] for x in a if e in x["events"]]
            if values:
                out.append(line(f"link_event_ms_{e}_{tag}", median(values), "ms"))
        out.append(describe(tag, min(a[0]["nodes"], key=lambda n: n["node"])))
    return out


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Node 0's two directions over the timed steps of each sampled key's first run, as shares of the rate."""
    keys = [k for k, rs in runs.items() if any(rec.get("link_samples") for rec in rs[0].get("records", []))]
    if not keys:
        return
    plt = pyplot()
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        rec = min((r for r in runs[key][0]["records"] if r.get("link_samples")), key=lambda r: r["node"])
        rate = parse_rate(key.split("|")[2]) / 8.0
        iv = rates(rec["link_samples"], rate)
        start = iv[0][0]
        xs = [1e3 * (a - start) for a, _, _, _ in iv]
        ax.step(xs, [tx / rate for _, _, tx, _ in iv], where="post", label="tx", lw=0.8)
        ax.step(xs, [rx / rate for _, _, _, rx in iv], where="post", label="rx", lw=0.8)
        for t0, _ in step_bounds(rec):
            ax.axvline(1e3 * (t0 - start), color="k", ls="--", lw=0.6)
        ax.set_ylabel("of the rate")
        ax.set_title(f"{key.replace('|', ' ')}: node 0's link (dashed: step starts)", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("ms")
    save_figure(fig, path)
