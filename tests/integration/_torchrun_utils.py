"""Start ``torchrun`` (one invocation per simulated node), or SLURM-like tasks, on 127.0.0.1 and wait, bounded.

Each invocation gets its own session (``start_new_session=True``), so on a timeout the test
kills exactly the process groups it created: the torchrun agent and the workers it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._workers import reserved_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_torchrun_fit.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def child_env() -> dict[str, str]:
    """One torch thread per process; the repo root and ``tests/`` importable."""
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "tests")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    return env


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return text[-chars:]


def run_torchrun_nodes(
    script_args: list[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    log_dir: Path,
    max_restarts: int = 0,
    rdzv_backend: str = "static",
    timeout: float = 120.0,
    script: Path = SCRIPT,
) -> list[str]:
    """Run ``script`` (default ``_torchrun_fit.py``) under ``nnodes`` torchrun invocations on 127.0.0.1.

    Args:
        script_args: the arguments of ``script``.
        nnodes: torchrun invocations, node ranks ``0 .. nnodes-1``, all on 127.0.0.1.
        nproc_per_node: worker processes per invocation.
        log_dir: where each invocation's stdout+stderr goes (``node<k>.log``).
        max_restarts: torchrun's ``--max-restarts``.
        rdzv_backend: ``"static"`` (``--master-addr/--master-port --node-rank``) or ``"c10d"``
            (``--rdzv-endpoint``; a fresh store prefix per rendezvous round, which restarts need:
            under ``static`` a restarted group reads the dead attempt's gloo addresses from the
            reused store and fails to connect).
        timeout: seconds for all invocations together; past it their process groups are killed.
        script: the worker script torchrun starts.

    Returns:
        Each node's output.

    Raises:
        TimeoutError: after killing every invocation, if they did not all exit in time.
        RuntimeError: with the output tails, if any invocation exited non-zero.
    """
    port = reserved_port()
    commands = []
    for node in range(nnodes):
        if rdzv_backend == "static":
            rdzv = ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
                    f"--node-rank={node}"]  # fmt: skip
        else:
            rdzv = [f"--rdzv-backend={rdzv_backend}", f"--rdzv-endpoint=127.0.0.1:{port}"]
        cmd = [
            *TORCHRUN,
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            *rdzv,
            f"--max-restarts={max_restarts}",
            str(script),
            *script_args,
        ]
        commands.append((cmd, child_env(), log_dir / f"node{node}.log"))
    return run_bounded(commands, what="torchrun", timeout=timeout)


def run_slurm_tasks(script_args: list[str], *, ntasks: int, log_dir: Path, timeout: float = 120.0) -> list[str]:
    """Run ``_torchrun_fit.py`` as ``srun --nodes N --ntasks-per-node 1`` would on N nodes.

    Each task gets the variables ``srun`` sets (``SLURM_NTASKS``, ``SLURM_PROCID``,
    ``SLURM_NODEID``, ``SLURM_LOCALID``, ...), so Lightning picks its ``SLURMEnvironment`` and
    starts no processes itself; ``MASTER_ADDR``/``MASTER_PORT`` point at 127.0.0.1 (on a real
    cluster Lightning derives them from ``SLURM_NODELIST`` and ``SLURM_JOB_ID``). Output goes to
    ``task<k>.log``. Returns and raises as :func:`run_torchrun_nodes`.
    """
    port = reserved_port()
    commands = []
    for task in range(ntasks):
        env = child_env()
        for key in [k for k in env if k.startswith(("TORCHELASTIC_", "SLURM_")) or k in ("RANK", "LOCAL_RANK")]:
            del env[key]  # a test run inside torchrun or a real allocation must not leak into the tasks
        env.update(
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="lightning-strategies-test",  # not "bash"/"interactive": those disable SLURM detection
            SLURM_NNODES=str(ntasks),
            SLURM_NTASKS=str(ntasks),
            SLURM_NTASKS_PER_NODE="1",
            SLURM_NODELIST="127.0.0.1",
            SLURM_PROCID=str(task),
            SLURM_NODEID=str(task),
            SLURM_LOCALID="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        commands.append(([sys.executable, str(SCRIPT), *script_args], env, log_dir / f"task{task}.log"))
    return run_bounded(commands, what="SLURM tasks", timeout=timeout)


def run_bounded(commands: list[tuple[list[str], dict[str, str], Path]], *, what: str, timeout: float) -> list[str]:
    """Start each ``(command, env, log)`` in its own session and wait for all, ``timeout`` seconds in all.

    Raises:
        TimeoutError: after killing every session, if they did not all exit in time.
        RuntimeError: with the output tails, if any command exited non-zero.
    """
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for cmd, env, log in commands:
            with log.open("wb") as f:
                proc = subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            procs.append((proc, log))
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        logs = "\n".join(f"--- {log.name}:\n{_tail(log)}" for _, log in procs)
        raise TimeoutError(f"{what} did not finish within {timeout:.0f}s; killed.\n{logs}") from None
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this test created, nothing else
                proc.wait(timeout=10)
    failed = [(proc, log) for proc, log in procs if proc.returncode != 0]
    if failed:
        raise RuntimeError(
            "\n".join(f"--- {log.name} exited with {proc.returncode}:\n{_tail(log)}" for proc, log in failed)
        )
    return [log.read_text(errors="replace") for _, log in procs]


def assert_node_push_bytes(records: list[dict[str, Any]], nodes: int, local: int) -> None:
    """The hierarchical push's bytes on 2 nodes of ``local``, from each rank's ``comm/`` values (``records``
    by rank, each with ``shard_numel`` and ``metrics``): local rank j pushes to the shard of local rank j on
    the other node and hears back from it, and a node's NIC carries ``node_nic_bytes``' formula (the flat
    push: L times as much)."""
    from lightning_strategies.comm.ps.hierarchy import node_nic_bytes
    from lightning_strategies.comm.ring import NodeLayout

    layout = NodeLayout.contiguous(nodes, local)
    shard_bytes = [n * 4 for n in records[0]["shard_numel"]]  # float32 gradients and values
    total = sum(shard_bytes)
    for n, ranks in enumerate(layout.nodes):
        here = sum(shard_bytes[r] for r in ranks)
        pushed = 0.0
        for j, r in enumerate(ranks):
            metrics = records[r]["metrics"]
            other = layout.nodes[1 - n][j]
            assert metrics["comm/inter_node_bytes_sent"] == shard_bytes[other], (r, metrics)
            assert metrics["comm/inter_node_bytes_received"] == shard_bytes[other], (r, metrics)
            pushed += metrics["comm/inter_node_bytes_sent"]
        assert pushed == total - here
        nic = pushed + (nodes - 1) * here  # its pushes out, and its shards' answers to the other node's pusher
        assert nic == node_nic_bytes(shard_bytes, layout, hierarchical=True)[n]
        assert 2 * nic == node_nic_bytes(shard_bytes, layout, hierarchical=False)[n]  # flat: L = 2 times as much
