"""The emulated cluster (``benchmarks/emulated``): clean up and down, honest shaping, ring bytes on the NICs.

Skipped, with the cluster's own reason, where it cannot be made (not root, no ip/tc/unshare, no HTB).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.cluster import MTU, PREFIX
from benchmarks.emulated.launch import launch

ROOT = Path(__file__).resolve().parents[2]
STREAM = ROOT / "benchmarks" / "_cluster_probe.py"
FIT = ROOT / "benchmarks" / "emulated" / "_fit.py"
OK, REASON = EmulatedCluster.available()
pytestmark = pytest.mark.skipif(not OK, reason=REASON)
# IPv4 TCP segment headers on the veth: Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12.
# The shaping test measures it; the byte tests subtract it per counted packet.
HEADER_BYTES = 66


def _host_state(token: str | None = None) -> dict[str, list[str]]:
    """The host's namespaces, links and routes; other runs' namespaces (another token) left out, so a
    cluster that another test or benchmark holds at the same time does not count as ours."""

    def out(*argv: str) -> list[str]:
        return sorted(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines())

    netns = [n for n in out("ip", "netns", "list") if not n.startswith(PREFIX) or (token and token in n)]
    return {"netns": netns, "link": out("ip", "-o", "link"), "route": out("ip", "route"),
            "route6": out("ip", "-6", "route")}  # fmt: skip


def _running(nap: str) -> bool:
    return subprocess.run(["pgrep", "-f", f"^sleep {nap}$"], capture_output=True).returncode == 0


def _wait_running(nap: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _running(nap):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_up_and_down_leave_nothing_behind() -> None:
    before = _host_state()
    with EmulatedCluster(nodes=3, rate="100mbit") as cluster:
        during = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(name in during for name in cluster.netns_names)
        # a node is a PID namespace of its own: the command is its init
        proc = cluster.popen(cluster.nodes[1], ["sh", "-c", "echo $$; cat /sys/class/net/*/address | wc -l"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        pid, links = proc.communicate(timeout=30)[0].split()
        assert (pid, links) == ("1", "2")  # lo and the node's own link, nothing of the host's
        token = cluster.token
    assert _host_state(token) == before


def test_exception_in_the_body_cleans_up() -> None:
    before = _host_state()
    with pytest.raises(RuntimeError, match="body failed"), EmulatedCluster(nodes=2, rate="100mbit") as cluster:
        token = cluster.token
        raise RuntimeError("body failed")
    assert _host_state(token) == before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler restored


HOLD = """
import sys, time
from benchmarks.emulated import EmulatedCluster
with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
    proc = cluster.popen(cluster.nodes[0], ["sleep", sys.argv[1]])
    print(cluster.token, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(sig: signal.Signals) -> None:
    before = _host_state()
    nap = f"600.{time.time_ns() % 10**6:06d}"  # a sleep no other process runs
    proc = subprocess.Popen([sys.executable, "-c", HOLD, nap], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        token = proc.stdout.readline().strip()
        assert token, "the cluster did not come up"
        assert any(token in n for n in _host_state(token)["netns"])
        assert _wait_running(nap)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # a failed assertion above: let the holder clean up, then make sure
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # SIGTERM: SystemExit(128 + 15); SIGINT: KeyboardInterrupt, which Python ends by SIGINT (-2)
    assert code == (143 if sig == signal.SIGTERM else -signal.SIGINT)
    assert _host_state(token) == before
    assert not _running(nap)  # the node's process died with its node


def test_shaping_holds_and_header_bytes() -> None:
    """A TCP stream from node 0 to node 1 at 100 Mbit/s: 0.9-1.02 x the rate, steady state."""
    rate = 100e6
    with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
        a, b = cluster.nodes
        py = sys.executable
        recv = cluster.popen(b, [py, str(STREAM), "stream-recv", b.address, "5001"], stdout=subprocess.PIPE)
        before = cluster.nic()
        send = cluster.popen(a, [py, str(STREAM), "stream-send", b.address, "5001", "2.5"], stdout=subprocess.PIPE)
        sent = json.loads(send.communicate(timeout=60)[0])["sent"]
        got = json.loads(recv.communicate(timeout=60)[0])
        after = cluster.nic()
    assert got["bytes"] == sent
    tx = after[0] - before[0]
    header = (tx.tx_bytes - sent) / tx.tx_packets  # the sender's packets: data, and the handshake's few
    goodput = got["steady_bytes"] * 8 / got["steady_seconds"]
    # HTB charges every MSS-sized segment its headers (qdisc_pkt_len of a GSO packet), as a real
    # NIC after segmentation puts them on the wire; the veth counters see a GSO packet once
    wire = goodput * (MTU - 52 + HEADER_BYTES) / (MTU - 52)  # MSS = MTU - IPv4 20 - TCP 32
    print(f"wire {wire / rate:.4f} x the rate (payload {goodput / rate:.4f}); {header:.1f} B of headers per packet")
    assert 0.9 <= wire / rate <= 1.02, f"wire rate {wire / 1e6:.1f} Mbit/s at 100mbit"
    assert abs(header - HEADER_BYTES) < 3, f"{header:.1f} B of headers per packet, expected {HEADER_BYTES}"


def _node_bytes_per_step(out: Path, steps: int, warmup: int) -> list[dict[str, float]]:
    rows = []
    for path in sorted(out.glob("rank*.json")):
        rec = json.loads(path.read_text())
        if rec["nic"]:
            s, e = rec["nic"]["start"], rec["nic"]["end"]
            n = steps - warmup
            rows.append({k: (e[k] - s[k]) / n for k in s} | {"node": rec["node"], "D": rec["params"] * 4})
    return sorted(rows, key=lambda r: r["node"])


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "over_d"), [("ring", 1.5), ("ring_hier", 1.0)])
def test_ring_bytes_on_each_nic(strategy: str, over_d: float) -> None:
    """Flat ring at 2 x 2: a node's NIC carries 2(P-1)/P D = 1.5 D each way per step; hierarchical:
    each of the node's 2 ranks all-reduces D/2 with its peer across: 2 x 2(2-1)/2 x D/2 = D."""
    steps, warmup = 6, 2
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        result = launch(cluster, ["python", str(FIT), "--strategy", strategy, "--steps", str(steps), "--warmup",
                                  str(warmup), "--out", tmp], per_node=2, timeout=120, echo=False)  # fmt: skip
        assert result.returncode == 0, result.outputs[0][-3000:] + result.outputs[1][-3000:]
        assert result.steps == steps  # the job told the launcher
        rows = _node_bytes_per_step(Path(tmp), steps, warmup)
    assert [r["node"] for r in rows] == [0, 1]
    for r in rows:
        for way in ("tx", "rx"):
            payload = r[f"{way}_bytes"] - HEADER_BYTES * r[f"{way}_packets"]
            print(
                f"{strategy} node {r['node']} {way}: {payload / r['D']:.4f} D payload, "
                f"{r[f'{way}_bytes'] / r['D']:.4f} D with headers"
            )
            # 2%: gloo's framing and the odd control message (measured: +0.01-0.1%)
            assert payload / (over_d * r["D"]) == pytest.approx(1.0, abs=0.02), (way, r)
    # the launcher's whole-run totals include set-up (the first broadcast of D, rendezvous): more, never less
    assert all(c.tx_bytes >= rows[i]["tx_bytes"] * (steps - warmup) for i, c in enumerate(result.nic))


@pytest.mark.slow
def test_launcher_timeout_kills_every_node_and_cleans_up() -> None:
    """A job past its timeout: every node's torchrun and workers killed, exit 124, nothing left behind."""
    before = _host_state()
    nap = f"600.{time.time_ns() % 10**6:06d}"
    start = time.monotonic()
    with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
        result = launch(cluster, ["sleep", nap], per_node=1, timeout=20, echo=False)
        token = cluster.token
        gone = time.monotonic() + 10  # the kernel ends a PID namespace's processes when its init dies
        while _running(nap) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not _running(nap)  # killed with their nodes, before the cluster goes down
    assert result.returncode == 124
    assert time.monotonic() - start < 50
    assert _host_state(token) == before
