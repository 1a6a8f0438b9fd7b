"""An emulated cluster on one machine: every node a set of namespaces of its own, links shaped by HTB.

A node is a network namespace holding one end of a veth pair (its "NIC"); the other end sits in a
switch namespace, enslaved to a bridge. HTB caps both directions of every link: the egress of the
node's end (what the node sends) and the egress of the switch's end towards the node (what it
receives). Each node has one address on a private /24 chosen at random per run, which exists only
inside these namespaces. Processes inside a node reach each other through the node's own address,
which the kernel routes over ``lo`` (like NVLink inside a server); traffic to other nodes crosses
the shaped link.

Commands run in a node as ``ip netns exec NS unshare --pid --ipc --uts --fork --mount-proc CMD``:
with network namespaces alone, TensorPipe sees one host and moves tensors by shared memory or
cross-memory attach, around the link (DESIGN.md, "Known mechanics").

Nothing on the host changes but the namespace list: every ``ip``/``tc`` command runs inside a
namespace this object created, and the veth pairs are created with both ends directly inside
namespaces. Every name carries a random token, so two runs cannot collide; on exit (also after an
exception, SIGINT or SIGTERM) every namespace is deleted, which deletes the links in it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

__all__ = ["ClusterUnavailableError", "EmulatedCluster", "EmulatedNode", "NicCounters", "parse_rate"]

PREFIX = "lsc"  # every namespace of every run starts with it (tests tell runs apart by the token)
MTU = 1500
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
# unshare's --kill-child: when the process we started dies (SIGKILL on timeout), its child, the
# PID namespace's init, gets SIGKILL, and with it every process of the node.
_NODE_WRAP = ("unshare", "--pid", "--ipc", "--uts", "--fork", "--mount-proc", "--kill-child")


class ClusterUnavailableError(RuntimeError):
    """The emulated cluster cannot be made on this machine (not root, a tool or HTB missing)."""


def parse_rate(rate: str) -> int:
    """A tc rate (``"200mbit"``, ``"1gbit"``, ``"500kbit"``) in bits per second.

    Raises:
        ValueError: for anything else.
    """
    m = _RATE.match(rate)
    if not m:
        raise ValueError(
            f"rate={rate!r}: found no number followed by bit/kbit/mbit/gbit: expected e.g. '200mbit'. "
            "Fix: pass the link rate as tc writes it"
        )
    bits = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if bits <= 0:
        raise ValueError(f"rate={rate!r}: found {bits} bit/s: expected a positive rate. Fix: pass e.g. '200mbit'")
    return bits


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterUnavailableError(
            f"`{' '.join(argv)}` exited with {proc.returncode}: found {proc.stderr.strip()!r}: expected success. "
            "Fix: run as root on a kernel with network namespaces, veth, bridge and sch_htb"
        )
    return proc


@dataclass(frozen=True)
class NicCounters:
    """A node's link counters (``/sys/class/net/<link>/statistics``), Ethernet headers included."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: NicCounters) -> NicCounters:
        return NicCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


@dataclass(frozen=True)
class EmulatedNode:
    """One node of an :class:`EmulatedCluster`.

    Attributes:
        index: 0 .. nodes-1.
        netns: the node's network namespace.
        link: the node's end of its veth pair, its NIC (the name inside ``netns``).
        address: the node's IPv4 address on the cluster's private subnet.
    """

    index: int
    netns: str
    link: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this node: its own network, PID, IPC and UTS namespaces."""
        return ["ip", "netns", "exec", self.netns, *_NODE_WRAP, *argv]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with gloo's and TensorPipe's interface set to the link, and
        the node's address in ``EMULATED_NODE_ADDR`` (what a job advertises to its peers, e.g.
        ``FTStrategy(hostname=...)``: the host name resolves outside the node)."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=self.link, TP_SOCKET_IFNAME=self.link, EMULATED_NODE_ADDR=self.address)
        return env

    def nic(self) -> NicCounters:
        """The link's byte and packet counters now, read inside the node's namespace."""
        files = [
            f"/sys/class/net/{self.link}/statistics/{k}" for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        ]
        out = _run(["ip", "netns", "exec", self.netns, "cat", *files]).stdout.split()
        tx, rx, txp, rxp = (int(v) for v in out)
        return NicCounters(tx, rx, txp, rxp)


class EmulatedCluster:
    """``nodes`` emulated nodes behind one switch, each link shaped to ``rate`` in both directions.

    Example::

        with EmulatedCluster(nodes=2, rate="200mbit") as cluster:
            node = cluster.nodes[0]
            proc = cluster.popen(node, ["python", "-c", "print('hello from node 0')"])
            proc.wait()

    Args:
        nodes: how many nodes (at least 1).
        rate: every link's rate, as tc writes it (``"200mbit"``).
        burst_s: HTB burst and cburst, as seconds of the rate (at least 2 full frames): small, so
            that a short measurement sees the rate and not a burst.
        subnet: the /24 to use (default: ``10.X.Y.0/24`` with X, Y random per run).

    Raises:
        ClusterUnavailableError: on entering, where the cluster cannot be made (see :meth:`available`).
        ValueError: for a bad ``nodes``, ``rate`` or ``subnet``.
    """

    def __init__(
        self, nodes: int = 2, rate: str = "200mbit", *, burst_s: float = 0.001, subnet: str | None = None
    ) -> None:
        if nodes < 1:
            raise ValueError(f"EmulatedCluster(nodes={nodes}): expected at least 1 node. Fix: pass nodes >= 1")
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.burst_bytes = max(2 * (MTU + 14), int(self.rate_bits / 8 * burst_s))
        net = ipaddress.ip_network(subnet or f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
        if net.num_addresses < nodes + 2:
            raise ValueError(f"subnet={subnet!r}: found {net.num_addresses} addresses: expected >= {nodes + 2}")
        self.subnet = str(net)
        self.token = secrets.token_hex(3)
        hosts = list(net.hosts())
        tag = f"{PREFIX}{self.token}"
        self.switch_netns = f"{tag}sw"
        self.nodes = [
            EmulatedNode(i, f"{tag}n{i}", f"{tag}n{i}", str(hosts[i])) for i in range(nodes)
        ]  # fmt: skip
        self._bridge = f"{tag}br"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._old_handlers: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def netns_names(self) -> list[str]:
        """Every namespace this cluster makes (switch first)."""
        return [self.switch_netns, *(n.netns for n in self.nodes)]

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether a cluster can be made here, and if not, why (found / needed / fix), for skips."""
        if os.geteuid() != 0:
            return False, (
                f"found uid {os.geteuid()}: the emulated cluster needs root (ip netns, tc). Fix: run as root"
            )
        missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
        if missing:
            return False, (
                f"found no {', '.join(missing)} on PATH: the emulated cluster needs iproute2 (ip, tc) and "
                "util-linux (unshare). Fix: install iproute2 and util-linux"
            )
        probe = f"{PREFIX}{secrets.token_hex(3)}pr"
        try:
            steps = [
                ["ip", "netns", "add", probe],
                ["ip", "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"],
                ["ip", "-n", probe, "link", "add", "name", "pbr", "type", "bridge"],
                ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "handle", "1:", "htb"],
                ["ip", "netns", "exec", probe, *_NODE_WRAP, "true"],
            ]
            for argv in steps:
                proc = _run(argv, check=False)
                if proc.returncode != 0:
                    return False, (
                        f"`{' '.join(argv)}` failed: found {proc.stderr.strip()!r}: expected network namespaces, "
                        "veth, HTB (sch_htb) and PID/IPC/UTS namespaces. Fix: run on a kernel with "
                        "CONFIG_NET_NS, CONFIG_VETH, CONFIG_BRIDGE and CONFIG_NET_SCH_HTB, as root"
                    )
        finally:
            _run(["ip", "netns", "del", probe], check=False)
        return True, "ok"

    def __enter__(self) -> EmulatedCluster:
        ok, reason = self.available()
        if not ok:
            raise ClusterUnavailableError(reason)
        self._install_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _install_handlers(self) -> None:
        # Signal handlers can only be set from the main thread; elsewhere the caller owns signals.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Raising unwinds the with-block, so __exit__ removes everything before the process ends.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _build(self) -> None:
        sw, br = self.switch_netns, self._bridge
        self._add_netns(sw)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "name", br, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", br, "up"])
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        for node in self.nodes:
            self._add_netns(node.netns)
            port = f"{PREFIX}{self.token}s{node.index}"
            # both ends born inside namespaces of ours: the host's link list never changes
            _run(["ip", "link", "add", "name", node.link, "netns", node.netns, "mtu", str(MTU), "type", "veth",
                  "peer", "name", port, "netns", sw, "mtu", str(MTU)])  # fmt: skip
            _run(["ip", "-n", sw, "link", "set", port, "master", br])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/{prefix}", "dev", node.link])
            _run(["ip", "-n", node.netns, "link", "set", node.link, "up"])
            self._shape(node.netns, node.link)  # what the node sends
            self._shape(sw, port)  # what the node receives

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        # no IPv6: its neighbour discovery and router solicitations would add stray bytes to the counters
        sysctl = ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        _run(["ip", "netns", "exec", name, *sysctl], check=False)

    def _shape(self, netns: str, dev: str) -> None:
        burst = str(self.burst_bytes)
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
        _run(["tc", "-n", netns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
              "rate", self.rate, "ceil", self.rate, "burst", burst, "cburst", burst,
              "quantum", str(MTU + 14)])  # fmt: skip

    def popen(self, node: EmulatedNode, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node`` in a session of its own; :meth:`close` kills it if still running.

        ``env`` defaults to :meth:`EmulatedNode.env` (gloo and TensorPipe on the node's link); the
        other keyword arguments go to :class:`subprocess.Popen`.
        """
        kwargs.setdefault("env", node.env())
        kwargs["start_new_session"] = True
        proc = subprocess.Popen(node.command(argv), **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[Any]) -> None:
        """SIGKILL ``proc``'s session (one :meth:`popen` made) and reap it."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def close(self) -> None:
        """Kill what :meth:`popen` started, delete every namespace made, restore the signal handlers."""
        # no signal may interrupt the clean-up itself
        blocked = self._old_handlers and threading.current_thread() is threading.main_thread()
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with self._lock:
                procs, self._procs = self._procs, []
            for proc in procs:
                self.kill(proc)
            for name in reversed(self._made):
                _run(["ip", "netns", "del", name], check=False)
            self._made = []
        finally:
            if blocked:
                for sig, handler in self._old_handlers.items():
                    signal.signal(sig, handler)
                self._old_handlers = {}
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def nic(self) -> list[NicCounters]:
        """Every node's link counters now."""
        return [node.nic() for node in self.nodes]
