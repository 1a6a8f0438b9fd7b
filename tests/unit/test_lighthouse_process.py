"""``start_lighthouse``: torchft's Lighthouse in a child process that answers, stops, and ends with its starter.

A launcher died of SIGSEGV three times in full suites while the Lighthouse ran as a server inside it; the
server now runs in a process of its own. These check what that process must do: listen where the handle
says, take the settings it was given (a quorum forms through it), stop on shutdown, end when the process
that started it dies (even of SIGKILL), and fail loudly, naming its command, when it cannot start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from lightning_strategies.comm.ft import check_lighthouse, start_lighthouse


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_the_lighthouse_listens_in_its_own_process_and_stops() -> None:
    handle = start_lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.1)
    try:
        assert handle.process is not None and handle.process.pid != os.getpid()
        assert handle.exit_code() is None
        assert check_lighthouse(handle.address, timeout_s=10.0) == handle.address
        assert "--min_replicas 1" in " ".join(handle.process.args)  # type: ignore[arg-type]
    finally:
        pid = handle.process.pid if handle.process else 0
        handle.shutdown()
    assert handle.process is None and _gone(pid, 10.0)
    handle.shutdown()  # idempotent


def test_a_quorum_forms_through_it() -> None:
    """A torchft client gets its quorum from the child process: the settings reached the server."""
    from torchft.coordination import LighthouseClient

    handle = start_lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.1)
    try:
        client = LighthouseClient(handle.address, connect_timeout=timedelta(seconds=10))
        quorum = client.quorum(replica_id="r0", timeout=timedelta(seconds=10))
        assert [m.replica_id for m in quorum.participants] == ["r0"]
    finally:
        handle.shutdown()


def test_the_lighthouse_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from lightning_strategies.comm.ft import start_lighthouse
        h = start_lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.1)
        print(h.process.pid, flush=True)
        os.kill(os.getpid(), 9)  # no shutdown, no atexit: SIGKILL
        """
    )
    starter = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert starter.returncode == -9, starter.stderr[-2000:]
    pid = int(starter.stdout.split()[0])
    assert _gone(pid, 10.0), f"the Lighthouse (pid {pid}) outlived the process that started it"


def test_a_lighthouse_that_cannot_start_says_why() -> None:
    with pytest.raises(RuntimeError, match=r"Lighthouse \(.*--bind \[::\]:70000.*\) ended with 1"):
        start_lighthouse(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.1, port=70000)
