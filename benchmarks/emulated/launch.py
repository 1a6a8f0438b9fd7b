"""Run a training command on an :class:`~benchmarks.emulated.cluster.EmulatedCluster` through torchrun.

Each node runs ``torchrun --nnodes N --nproc-per-node L --node-rank i --master-addr <node 0>
--master-port P CMD`` inside its namespaces, so the job sees torchrun's environment and Lightning
its ``TorchElasticEnvironment``, exactly as on a real multi-node job. The launcher reads every node's
NIC counters before and after and reports the bytes that crossed each link, per step when the step
count is known: from ``--steps``, or from the file named by ``$EMULATED_CLUSTER_STEPS_FILE``, into
which the job may write its step count (an integer). Bounded: past ``timeout`` it kills the node
sessions it started (with them every process of the node: see ``--kill-child`` in cluster.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks.emulated.cluster import EmulatedCluster, NicCounters

__all__ = ["STEPS_FILE_ENV", "LaunchResult", "launch", "report_start", "torchrun_command"]

STEPS_FILE_ENV = "EMULATED_CLUSTER_STEPS_FILE"
MASTER_PORT = 29500  # every cluster is a fresh set of namespaces: nothing else listens there
REPO = Path(__file__).resolve().parents[2]


@dataclass
class LaunchResult:
    """What one :func:`launch` did.

    Attributes:
        returncode: the job's: the first non-zero node exit status, 0 when every node succeeded,
            124 after a timeout.
        nic: per node, the counters' change over the whole run (set-up included).
        steps: the step count (``--steps`` or the job's steps file), None when unknown.
        outputs: per node, torchrun's output (stdout and stderr).
        seconds: wall time of the job.
    """

    returncode: int
    nic: list[NicCounters]
    steps: int | None
    outputs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def report(self) -> list[str]:
        """One line per node: tx/rx bytes, and per step when the step count is known."""
        rows = []
        for i, c in enumerate(self.nic):
            text = f"node {i}: tx {c.tx_bytes} B, rx {c.rx_bytes} B ({c.tx_packets}/{c.rx_packets} packets)"
            if self.steps:
                text += f"; per step: tx {c.tx_bytes / self.steps:.0f} B, rx {c.rx_bytes / self.steps:.0f} B"
            rows.append(text)
        return rows


def torchrun_command(argv: Sequence[str], *, nodes: int, per_node: int, node_rank: int, master: str) -> list[str]:
    """``argv`` (``python script.py ...``, ``python -m module ...`` or any program) under torchrun."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master}", f"--master-port={MASTER_PORT}",
            "--max-restarts=0"]  # fmt: skip
    if not argv:
        raise ValueError("found no command: expected e.g. `python train.py ...` after `--`. Fix: add the command")
    if Path(argv[0]).name.startswith("python"):
        return [*head, *argv[1:]]  # torchrun runs a script or `-m module` with its own interpreter
    return [*head, "--no-python", *argv]


def report_start(title: str) -> list[str] | None:
    """A cluster benchmark's first lines, printed: the header (machine, versions, date) and the load
    now; None, after a ``# skipped:`` line with the reason, where no cluster can be made here."""
    from benchmarks._common import header, load_line

    text = [header(title)]
    print(text[0], flush=True)
    ok, reason = EmulatedCluster.available()
    if not ok:
        print(f"# skipped: {reason}", flush=True)
        return None
    text.append(load_line("start"))
    print(text[-1], flush=True)
    return text


def _pump(stream: IO[bytes], prefix: str, sink: list[str], echo: bool) -> None:
    for raw in iter(stream.readline, b""):
        text = raw.decode(errors="replace")
        sink.append(text)
        if echo:
            sys.stdout.write(f"{prefix}{text}")
            sys.stdout.flush()


def launch(
    cluster: EmulatedCluster,
    argv: Sequence[str],
    *,
    per_node: int,
    timeout: float = 600.0,
    steps: int | None = None,
    env: dict[str, str] | None = None,
    echo: bool = True,
) -> LaunchResult:
    """Run ``argv`` under torchrun on every node of ``cluster`` (entered); wait, bounded.

    Args:
        cluster: the cluster, already entered.
        argv: the job's command.
        per_node: processes per node (torchrun's ``--nproc-per-node``).
        timeout: seconds for the whole job; then every node's session is killed (returncode 124).
        steps: the job's step count, for bytes per step; else read from ``$EMULATED_CLUSTER_STEPS_FILE``.
        env: extra environment variables for the job.
        echo: print every node's output, prefixed ``[node i]``, as it comes.
    """
    master = cluster.nodes[0].address
    with tempfile.TemporaryDirectory(prefix="emulated-") as tmp:
        steps_file = Path(tmp) / "steps"
        base = dict(os.environ)
        paths = [str(REPO), str(REPO / "tests"), *filter(None, [base.get("PYTHONPATH")])]
        base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
        base[STEPS_FILE_ENV] = str(steps_file)
        base.update(env or {})
        before = cluster.nic()
        start = time.monotonic()
        procs, pumps, outputs = [], [], []
        for node in cluster.nodes:
            cmd = torchrun_command(argv, nodes=len(cluster.nodes), per_node=per_node, node_rank=node.index,
                                   master=master)  # fmt: skip
            proc = cluster.popen(
                node, cmd, env=node.env(base), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            sink: list[str] = []
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[node {node.index}] ", sink, echo), daemon=True)
            pump.start()
            procs.append(proc)
            pumps.append(pump)
            outputs.append(sink)
        deadline = start + timeout
        timed_out = False
        for proc in procs:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
            if timed_out:
                break
        if timed_out:
            for proc in procs:
                cluster.kill(proc)
        seconds = time.monotonic() - start
        for pump in pumps:
            pump.join(timeout=10)
        after = cluster.nic()
        codes = [proc.returncode for proc in procs]
        returncode = 124 if timed_out else next((c for c in codes if c != 0), 0)
        if steps is None and steps_file.exists():
            text = steps_file.read_text().strip()
            steps = int(text) if text.isdigit() else None
    return LaunchResult(returncode, [a - b for a, b in zip(after, before, strict=True)], steps,
                        ["".join(o) for o in outputs], seconds)  # fmt: skip


def main(args: Any = None) -> int:
    """``python -m benchmarks.emulated``: see the module docstring (``--help``)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.emulated",
        description="Run a command under torchrun on an emulated cluster (nodes as namespaces, HTB-shaped links).",
        epilog="example: python -m benchmarks.emulated --nodes 2 --per-node 2 --rate 200mbit -- "
        "python train.py strategy=ring trainer=cpu",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=1, help="processes per node (torchrun --nproc-per-node)")
    parser.add_argument("--rate", default="200mbit", help="every link's rate, both directions, as tc writes it")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds; then every node is killed")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"the job's step count for bytes per step (else the job may write it to ${STEPS_FILE_ENV})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command, e.g. python train.py ...")
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("found no command: expected `-- python train.py ...` at the end")
    with EmulatedCluster(nodes=ns.nodes, rate=ns.rate) as cluster:
        print(f"# emulated cluster: {ns.nodes} nodes x {ns.per_node}, {ns.rate} per link, subnet {cluster.subnet}, "
              f"master {cluster.nodes[0].address}:{MASTER_PORT}", flush=True)  # fmt: skip
        result = launch(cluster, command, per_node=ns.per_node, timeout=ns.timeout, steps=ns.steps)
    for row in result.report():
        print(f"# {row}", flush=True)
    if result.returncode == 124:
        print(f"# timed out after {ns.timeout:.0f} s: every node killed", flush=True)
    print(f"# exit {result.returncode} after {result.seconds:.1f} s", flush=True)
    return result.returncode
