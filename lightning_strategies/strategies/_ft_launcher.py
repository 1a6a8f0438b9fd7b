"""The launcher of ``"ft"`` / ``"local_sgd"`` / ``"diloco"``: a Lighthouse, the replicas, a supervisor.

Lightning's ``popen`` launcher starts one process per device by re-running the script, then
watches them with an observer that SIGKILLs every process as soon as one fails: the opposite of
fault tolerance. This one starts the same children (Lightning's own
``_call_children_scripts``) but, first, a torchft Lighthouse as a child process (unless the strategy
was given ``lighthouse="host:port"``), and instead of the observer a :class:`ReplicaSupervisor`
thread that starts a child that died again, with the same local rank, up to ``max_restarts``
times per replica. The restarted replica heals from a live one (see ``strategies/ft.py``).

This process is replica 0 and runs the supervisor; the Lighthouse ends with it: losing it ends the job
(torchft's Lighthouse is a single point of failure anyway); the other replicas may die and come back.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_strategies.comm.ft import LighthouseHandle, start_lighthouse

__all__ = ["LIGHTHOUSE_ENV", "RESTART_ENV", "FTScriptLauncher", "LighthouseSettings", "ReplicaSupervisor"]

log = logging.getLogger(__name__)

#: Where the children find the Lighthouse the launcher started (torchft's own variable).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: How many times this replica was started again (0 in a first start).
RESTART_ENV = "LS_FT_RESTART"


@dataclass(frozen=True)
class LighthouseSettings:
    """The Lighthouse the launcher starts (see :func:`~lightning_strategies.comm.ft.start_lighthouse`)."""

    min_replicas: int
    heartbeat_timeout_s: float
    join_timeout_s: float
    host: str = "127.0.0.1"


@dataclass
class ReplicaSupervisor:
    """A thread that polls the children and starts a failed one again (same local rank).

    Args:
        procs: the children, ``procs[i]`` with local rank ``i + 1``; replaced in place on restart.
        restart: ``restart(local_rank, restarts)`` starts a child and returns it.
        max_restarts: restarts allowed per replica.
        poll_s: seconds between two polls.
    """

    procs: list[subprocess.Popen]
    restart: Callable[[int, int], subprocess.Popen]
    max_restarts: int
    poll_s: float = 0.1
    restarts: dict[int, int] = field(default_factory=dict)
    #: ``(time, local_rank, returncode, restarted)`` of every child that ended with an error
    events: list[tuple[float, int, int, bool]] = field(default_factory=list)
    _given_up: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ReplicaSupervisor:
        self._thread = threading.Thread(target=self._run, name="ft-supervisor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Start again every child that ended with an error and has restarts left."""
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            rank = i + 1
            if code is None or code == 0 or rank in self._given_up or self._stop.is_set():
                continue
            used = self.restarts.get(rank, 0)
            again = used < self.max_restarts
            self.events.append((time.time(), rank, code, again))
            if not again:
                log.warning(f"ft: replica {rank} ended with {code} and has used its {used} restarts; the others go on")
                self._given_up.add(rank)
                continue
            self.restarts[rank] = used + 1
            log.warning(f"ft: replica {rank} ended with {code}; starting it again ({used + 1}/{self.max_restarts})")
            self.procs[i] = self.restart(rank, used + 1)

    def stop(self) -> None:
        """No more restarts; returns once the thread has ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)


class FTScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher with a Lighthouse and a supervisor instead of the observer.

    Args:
        cluster_environment, num_processes, num_nodes: as Lightning's ``_SubprocessScriptLauncher``.
        lighthouse: start one with these settings, or ``None`` when the strategy was given an address.
        max_restarts: restarts per replica.
        finish_timeout_s: how long replica 0, done, waits for the other replicas to end.
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        *,
        lighthouse: LighthouseSettings | None,
        max_restarts: int,
        finish_timeout_s: float,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.lighthouse_settings = lighthouse
        self.max_restarts = max_restarts
        self.finish_timeout_s = finish_timeout_s
        self.lighthouse: LighthouseHandle | None = None
        self.supervisor: ReplicaSupervisor | None = None

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        settings = self.lighthouse_settings
        if settings is not None and self.lighthouse is None:
            self.lighthouse = start_lighthouse(
                min_replicas=settings.min_replicas,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                join_timeout_s=settings.join_timeout_s,
                host=settings.host,
            )
            os.environ[LIGHTHOUSE_ENV] = self.lighthouse.address  # the children inherit it
        self._call_children_scripts()
        command = {i + 1: [str(a) for a in p.args] for i, p in enumerate(self.procs)}  # type: ignore[union-attr]
        cwd = {i + 1: _cwd_of(p) for i, p in enumerate(self.procs)}

        def restart(rank: int, restarts: int) -> subprocess.Popen:
            env = dict(os.environ, LOCAL_RANK=str(rank), **{RESTART_ENV: str(restarts)})
            return subprocess.Popen(command[rank], env=env, cwd=cwd[rank])

        self.supervisor = ReplicaSupervisor(self.procs, restart, self.max_restarts).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        finally:
            self._finish()

    def _finish(self) -> None:
        """Stop restarting, wait (bounded) for the other replicas, then stop the Lighthouse."""
        if self.supervisor is not None:
            self.supervisor.stop()
        deadline = time.monotonic() + self.finish_timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(f"ft: replica process {proc.pid} still runs {self.finish_timeout_s:g} s after replica 0 "
                            "finished; killing it")  # fmt: skip
                proc.kill()
                proc.wait(timeout=10.0)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None


def _cwd_of(proc: subprocess.Popen) -> str:
    """The working directory ``proc`` was started in (Lightning starts Hydra runs' children in the
    original directory): read from ``/proc`` right after the start, else this process's."""
    try:
        return os.readlink(f"/proc/{proc.pid}/cwd")
    except OSError:  # not Linux, or already gone
        return os.getcwd()
