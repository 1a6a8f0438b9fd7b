"""A node's link cut during a fit on the emulated cluster: the survivors name the unreachable ranks in
time, and the run resumes exactly from its last checkpoint once the link is back.

One test per family (ring; ps and async; pipeline; tensor), each on 2 emulated nodes x 1 process
(``benchmarks/emulated``: every node its own network, PID, IPC and UTS namespaces, links shaped by
HTB), through torchrun exactly as a multi-node job. Each runs ``_cluster_fault_fit.py`` three times
on one cluster:

1. the reference: ``EPOCHS`` epochs uninterrupted;
2. the cut: at the start of epoch ``CUT_EPOCH`` rank 0 asks for the cut and waits; the test takes
   node 1's link down (``ip link set <link> down`` inside node 1's network namespace), and rank 0
   goes on into its step. Node 0 holds the job's store, so rank 0 is the survivor that can
   diagnose: it must fail with ``"<strategy>: lost peer rank 1 of 2:"`` (the heartbeat diagnosis,
   :mod:`lightning_strategies.comm.heartbeat`), naming no other rank, within the strategy's
   ``timeout`` (``TIMEOUT_S``) + the diagnosis (2.5 s) + ``SLACK_S`` of the cut; with the watch's
   grace at ``GRACE_S`` it is expected well before the timeout. Node 1, cut off from the store, is
   killed once node 0 has exited (it cannot diagnose anything: it reaches nobody);
3. the link back up (``ip link set <link> up``), the same job resumed from ``ckpt/last.ckpt``
   (the end of epoch ``CUT_EPOCH - 1``) to the end.

Nothing is lost: the resumed run's final checkpoint holds the reference's weights, optimizer
state (momentum buffers) and step, bit for bit (``atol=0``; see ``test_resume_exact.py`` for why
the synchronous strategies are bit-exact). Async applies pushes in arrival order, so no two of its
runs are bitwise equal: there the resumed run must end at the reference's epoch and step
(``test_resume_exact.py`` holds async's restored shard state to its checkpoint).

Skipped, with the cluster's own reason, where it cannot be made (not root, no ip/tc/unshare, no HTB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from benchmarks.emulated import EmulatedCluster
from benchmarks.emulated.cluster import EmulatedNode
from benchmarks.emulated.launch import REPO, torchrun_command

FIT = Path(__file__).with_name("_cluster_fault_fit.py")
OK, REASON = EmulatedCluster.available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=REASON)]

EPOCHS = 5  # 2 steps each
CUT_EPOCH = 3  # the cut falls after the checkpoint of epoch 2, in epoch 3's first step
TIMEOUT_S = 15.0  # the strategies' timeout
GRACE_S = 3.0  # their heartbeat watch's grace (peer_watch_grace)
DIAGNOSIS_S = 2.5  # the heartbeat diagnosis' own watch after a failure (heartbeat.py)
SLACK_S = 5.0  # a loaded 2-core machine
JOB_TIMEOUT_S = 180.0  # start-up alone took 50 s at load 65
LABELS = {"ps": "parameter_server"}  # the name each strategy's errors give it (its strategy_name)


def set_link(node: EmulatedNode, up: bool) -> None:
    """Take ``node``'s link (its NIC) down or up, inside the node's network namespace only."""
    subprocess.run(["ip", "-n", node.netns, "link", "set", node.link, "up" if up else "down"], check=True,
                   capture_output=True, timeout=30)  # fmt: skip


class Job:
    """One torchrun per node of ``cluster``, started now; output kept per node."""

    def __init__(self, cluster: EmulatedCluster, argv: list[str]) -> None:
        self.cluster = cluster
        env = dict(os.environ)
        paths = [str(REPO), str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
        master = cluster.nodes[0].address
        self.procs: list[subprocess.Popen[bytes]] = []
        self.outputs: list[list[str]] = []
        for node in cluster.nodes:
            cmd = torchrun_command(["python", *argv], nodes=len(cluster.nodes), per_node=1, node_rank=node.index,
                                   master=master)  # fmt: skip
            proc = cluster.popen(node, cmd, env=node.env(env), cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)  # fmt: skip
            sink: list[str] = []
            assert proc.stdout is not None
            threading.Thread(target=self._pump, args=(proc.stdout, sink), daemon=True).start()
            self.procs.append(proc)
            self.outputs.append(sink)

    @staticmethod
    def _pump(stream: IO[bytes], sink: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            sink.append(raw.decode(errors="replace"))

    def wait(self, node: int, deadline: float) -> int | None:
        """Node ``node``'s exit status, or None if it still runs at ``deadline`` (monotonic)."""
        proc = self.procs[node]
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return proc.poll()

    def kill(self) -> None:
        for proc in self.procs:
            self.cluster.kill(proc)

    def text(self, node: int) -> str:
        return "".join(self.outputs[node])

    def tails(self) -> str:
        return "\n".join(f"--- node {i}:\n{self.text(i)[-3000:]}" for i in range(len(self.procs)))


@contextmanager
def job(cluster: EmulatedCluster, argv: list[str]) -> Iterator[Job]:
    j = Job(cluster, argv)
    try:
        yield j
    finally:
        j.kill()


def run_to_end(cluster: EmulatedCluster, argv: list[str]) -> None:
    start = time.monotonic()
    with job(cluster, argv) as j:
        deadline = start + JOB_TIMEOUT_S
        codes = [j.wait(i, deadline) for i in range(len(j.procs))]
        assert codes == [0] * len(j.procs), f"exit statuses {codes}\n{j.tails()}"
    print(f"{argv[2]}: a fit to the end took {time.monotonic() - start:.1f} s")


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_tensors(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def cut_and_resume(strategy: str, tmp_path: Path) -> None:
    common = ["--strategy", strategy, "--epochs", str(EPOCHS), "--timeout", str(TIMEOUT_S), "--grace", str(GRACE_S)]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        run_to_end(cluster, [str(FIT), *common, "--out", str(ref)])
        victim = cluster.nodes[1]
        with job(cluster, [str(FIT), *common, "--out", str(cut), "--cut-epoch", str(CUT_EPOCH)]) as j:
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while not (cut / "cut.request").exists():
                assert time.monotonic() < deadline and all(p.poll() is None for p in j.procs), (
                    f"the fit never reached epoch {CUT_EPOCH}\n{j.tails()}"
                )
                time.sleep(0.02)
            set_link(victim, up=False)
            cut_time = time.time()
            (cut / "cut.done").write_text("")
            limit = TIMEOUT_S + DIAGNOSIS_S + SLACK_S
            code = j.wait(0, time.monotonic() + limit + 30)
            assert code not in (None, 0), f"node 0 exit {code} after the cut\n{j.tails()}"
            record_path = cut / "rank0.exception"
            assert record_path.exists(), f"rank 0 failed without an exception record\n{j.tails()}"
            record = json.loads(record_path.read_text())
            named_after = record["time"] - cut_time
            message = record["message"]
            print(f"{strategy}: rank 0 failed {named_after:.1f} s after the cut: {message[:300]}")
            assert f"{LABELS.get(strategy, strategy)}: lost peer rank 1 of 2:" in message, f"{message}\n{j.tails()}"
            assert "rank 0 " not in message.split("lost peer", 1)[1].split(":", 1)[0]
            assert named_after <= limit, f"named {named_after:.1f} s after the cut, expected <= {limit:.1f} s"
            exit_path = cut / "rank0.exit"
            teardown = json.loads(exit_path.read_text())["time"] - record["time"] if exit_path.exists() else None
            print(
                f"{strategy}: node 0 exited {time.time() - cut_time:.1f} s after the cut; rank 0's teardown "
                f"took {teardown if teardown is None else round(teardown, 1)} s"
            )
        set_link(victim, up=True)
        last = cut / "ckpt" / "last.ckpt"
        saved = load(last)
        assert saved["epoch"] == CUT_EPOCH - 1
        # the cut fell in the step right after that checkpoint: only that step is lost, and redone. Under ps's
        # overlap (its default) that step's optimizer step returns once its pushes are out, so the loss shows in
        # the next forward, waiting for the step's values (Lightning has counted the step by then), unless the
        # peer watch names the peer before that step ends
        first = saved["global_step"]
        assert record["step"] in ((first, first + 1) if strategy == "ps" else (first,)), (record, first)
        if strategy != "async":  # async's ranks share the epoch's batches: fewer steps each
            assert saved["global_step"] == 2 * CUT_EPOCH
        resumed = tmp_path / "resumed"
        run_to_end(cluster, [str(FIT), *common, "--out", str(resumed), "--resume", str(last)])
    a, b = load(ref / "ckpt" / "last.ckpt"), load(resumed / "ckpt" / "last.ckpt")
    assert a["epoch"] == b["epoch"] == EPOCHS - 1
    assert a["global_step"] == b["global_step"]
    if strategy == "async":
        return
    assert a["global_step"] == 2 * EPOCHS
    assert_same_tensors(a["state_dict"], b["state_dict"], "state_dict")
    assert_same_tensors(a["optimizer_states"], b["optimizer_states"], "optimizer_states")


def test_ring_link_cut(tmp_path: Path) -> None:
    cut_and_resume("ring", tmp_path)


@pytest.mark.parametrize("strategy", ["ps", "async"])
def test_parameter_server_link_cut(strategy: str, tmp_path: Path) -> None:
    cut_and_resume(strategy, tmp_path)


def test_pipeline_link_cut(tmp_path: Path) -> None:
    cut_and_resume("pipeline", tmp_path)


def test_tensor_link_cut(tmp_path: Path) -> None:
    cut_and_resume("tensor", tmp_path)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-x", "-s"]))
