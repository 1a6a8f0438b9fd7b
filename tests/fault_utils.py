"""Run training ranks as independent processes, forked from one pre-imported *zygote*.

The fault tests need ranks that behave like processes on different nodes: nothing (no
``torchrun`` agent, no Lightning launcher, no ``multiprocessing`` parent) may kill the survivors
when one rank dies, and each rank must end the way a real script ends, with a normal interpreter
exit (atexit handlers, thread joins, process-group destructors): a hang there is one of the
faults under test. A fresh ``python`` per rank does all that but pays ~5 s of CPU importing torch
and Lightning each time; so one zygote process imports them once and forks every rank of every
case. A forked rank leaves the zygote's serving loop, returns to the module's top level and runs
the case's target there, as a script's main would: an uncaught exception prints its traceback
and exits 1, a clean return exits 0.

The zygote runs in a session of its own (``start_new_session=True``) and every rank in that
session, so :meth:`Zygote.leftovers` lists any process a case left behind, and :meth:`Zygote.close`
kills exactly that session, nothing else. Every wait is bounded: the zygote SIGKILLs the ranks
of a case that outlive its ``timeout`` (they are its children) and reports them as timed out.

Protocol (one JSON object per line): the test writes a :class:`Job` with an ``id``; the zygote
forks its ``world`` ranks at once (several jobs may run side by side), each calling
``function(rank, world, **kwargs)`` with ``env`` set and stdout/stderr in ``log_dir/rank<r>.log``,
and answers ``{"id", "ranks": {r: {"pid", "returncode", "exit_time", "cpu_s"}}, "timed_out": [...],
"wall_s"}`` once all of them have exited (``returncode`` as in ``subprocess``: ``-9`` for SIGKILL;
``exit_time`` is ``time.time()`` at reaping, within 20 ms; ``cpu_s`` the rank's user + system CPU
seconds).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

__all__ = ["Job", "Zygote", "run_forked", "run_script", "script_rank", "session_members"]


def session_members(sid: int) -> list[int]:
    """PIDs of the live processes of session ``sid`` (zombies included: not yet reaped)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # fields after the command (which may hold spaces) start after the last ')'
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            members.append(int(entry.name))
    return members


def run_script(rank: int, world: int, *, script: str, argv: list[str], stderr: str, pythonpath: str | None) -> None:
    """A :class:`Job` target: run ``script`` with ``argv`` as ``python script ARGV`` would, as ``__main__``.

    For scripts run many times from a test (the benchmarks' quick modes): the zygote's imports stand
    in for the script's own. ``sys.path`` and ``PYTHONPATH`` are a fresh interpreter's (the script's
    folder first, then ``pythonpath``, the caller's): the zygote's own path entries (the repository,
    ``tests``) are gone, so a script that does not put the repository on its path fails here as it
    would for a user. The rank's log is the script's stdout; its stderr goes to ``stderr``, with the
    fault handler on (what ``PYTHONFAULTHANDLER=1`` does for a fresh interpreter).
    """
    import faulthandler
    import runpy

    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()
    own = {str(REPO), str(REPO / "tests"), str(REPO / "tests" / "integration")}
    given = [p for p in (pythonpath or "").split(os.pathsep) if p]
    rest = [p for p in sys.path if p not in own and p not in given]
    sys.path[:] = [str(Path(script).resolve().parent), *given, *rest]
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    else:
        os.environ.pop("PYTHONPATH", None)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def script_rank(rank: int, world: int, *, cwd: str, **kwargs: Any) -> None:
    """A :class:`Job` target for :func:`run_forked`: a process group of its own (so that a timeout ends what the
    script started too), ``cwd``, then :func:`run_script`."""
    os.setpgid(0, 0)
    os.chdir(cwd)
    run_script(rank, world, **kwargs)


#: what :func:`run_forked`'s zygote imports: the app's entry point (train.py: hydra, omegaconf, recipes.app) and
#: the library and test helpers the fit scripts import (none of them starts a thread)
FORKED_PRELOAD = ["hydra", "omegaconf", "recipes.app", "lightning_strategies", "lightning_utils"]
_FORKED: dict[str, Any] = {}  # this process's zygote for run_forked, started by its first call


def run_forked(
    script: str, argv: list[str], *, cwd: Path, timeout: float, pythonpath: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGV`` from ``cwd`` with ``pythonpath`` as its ``PYTHONPATH``, as a process forked from a
    zygote that imported :data:`FORKED_PRELOAD` once for this test process (closed when it exits), where the
    script runs as ``__main__`` (:func:`run_script`: a fresh interpreter's ``sys.path``). Its environment is the
    zygote's (this process's at the first call, less the launchers' variables: :class:`Zygote`) with ``env`` on
    top: set what a run needs in ``env``, not in ``os.environ``. What the script starts (a launcher's ranks, a
    sweep's jobs) is what it starts under ``python``. Past ``timeout`` the script and its process group are killed
    and ``subprocess.TimeoutExpired`` raised."""
    if "zygote" not in _FORKED:
        home = Path(tempfile.mkdtemp(prefix="forked-"))
        zygote = Zygote(FORKED_PRELOAD, home / "zygote.log")

        def close() -> None:
            zygote.close()
            shutil.rmtree(home, ignore_errors=True)

        atexit.register(close)
        _FORKED.update(zygote=zygote, home=home)
    logs = Path(tempfile.mkdtemp(prefix="run-", dir=_FORKED["home"]))
    command = [sys.executable, script, *argv]
    try:
        kwargs = {"script": script, "argv": argv, "stderr": str(logs / "stderr.log"), "pythonpath": pythonpath,
                  "cwd": str(cwd)}  # fmt: skip
        job = Job(target="fault_utils:script_rank", world=1, env=env, kwargs=kwargs, log_dir=logs, timeout=timeout)
        answer = _FORKED["zygote"].run(job)
        rank = answer["ranks"][0]
        if answer["timed_out"]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank["pid"], signal.SIGKILL)  # the group script_rank made: what the script started
            raise subprocess.TimeoutExpired(command, timeout)
        out, err = logs / "rank0.log", logs / "stderr.log"
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace") if err.exists() else ""
        return subprocess.CompletedProcess(command, rank["returncode"], stdout, stderr)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@dataclass(frozen=True)
class Job:
    """One case: ``world`` ranks, forked by the zygote, each running ``target(rank, world, **kwargs)``.

    Attributes:
        target: ``"module:function"``, importable in the zygote.
        world: the number of ranks.
        env: environment of every rank; ``{rank}`` in a value becomes the rank.
        kwargs: keyword arguments of ``target`` (JSON).
        log_dir: where ``rank<r>.log`` (the rank's stdout and stderr) goes.
        timeout: seconds after which the zygote SIGKILLs the ranks still running.
        kill_stopped: SIGKILL the ranks that are stopped (SIGSTOP) once all others have exited.
    """

    target: str
    world: int
    env: dict[str, str]
    kwargs: dict[str, Any]
    log_dir: Path
    timeout: float
    kill_stopped: bool = False


class Zygote:
    """A pre-imported Python process that forks the ranks of each job (see the module doc).

    Args:
        preload: modules to import once in the zygote (every rank inherits them).
        log: where the zygote's own stderr goes.
    """

    def __init__(self, preload: list[str], log: Path) -> None:
        env = dict(os.environ)
        paths = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "integration")]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))
        # the ranks are launched "by hand": no cluster environment may claim them
        for key in list(env):
            if key.startswith(("TORCHELASTIC_", "SLURM_", "LSB_", "OMPI_", "PMI_")) or key in ("RANK", "LOCAL_RANK"):
                del env[key]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *preload],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self.log = log
        self._ready = False
        self._buffer = b""

    @property
    def sid(self) -> int:
        """The zygote's session (its pid)."""
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Wait until the zygote has imported ``preload``."""
        if not self._ready:
            line = self._readline(timeout, "import the preloaded modules")
            if json.loads(line).get("ready") is not True:
                raise RuntimeError(f"zygote: unexpected greeting {line!r}")
            self._ready = True

    def run(self, job: Job) -> dict[str, Any]:
        """Run one job and return its answer (see the module doc)."""
        return self.run_many([job], parallel=1)[0]

    def run_many(self, jobs: Sequence[Job], *, parallel: int) -> list[dict[str, Any]]:
        """Run ``jobs``, at most ``parallel`` at a time, in order; return their answers in order.

        Each answer also holds ``wall_s``: seconds from the first fork to the last reaping.
        """
        self.wait_ready(120.0)
        assert self.proc.stdin is not None
        todo = list(enumerate(jobs))
        deadlines: dict[int, float] = {}
        answers: dict[int, dict[str, Any]] = {}
        while todo or deadlines:
            while todo and len(deadlines) < parallel:
                i, job = todo.pop(0)
                request = {**asdict(job), "log_dir": str(job.log_dir), "id": i}
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
                deadlines[i] = time.monotonic() + job.timeout + 30.0  # the zygote kills at job.timeout
            wait = max(0.1, min(deadlines.values()) - time.monotonic())
            answer = json.loads(self._readline(wait, f"finish jobs {sorted(deadlines)}"))
            answer["ranks"] = {int(r): v for r, v in answer["ranks"].items()}
            answers[answer["id"]] = answer
            del deadlines[answer["id"]]
        return [answers[i] for i in range(len(jobs))]

    def leftovers(self) -> list[int]:
        """Processes of the zygote's session other than the zygote itself."""
        return [pid for pid in session_members(self.sid) if pid != self.proc.pid]

    def close(self, timeout: float = 10.0) -> None:
        """Ask the zygote to exit; past ``timeout`` kill its whole session (ours alone)."""
        try:
            if self.proc.stdin is not None and self.proc.poll() is None:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            pass
        finally:
            if session_members(self.sid):
                os.killpg(self.sid, signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)
            self._log.close()

    def _readline(self, timeout: float, what: str) -> str:
        """The zygote's next line; our own buffer, since two answers may arrive in one read."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                raise TimeoutError(
                    f"zygote did not {what} within {timeout:.0f}s (exit code {self.proc.poll()}):\n{tail}"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


# -- the zygote itself (runs as ``python fault_utils.py MODULE...``) ----------------------------------


@dataclass
class _Running:
    request: dict[str, Any]
    pids: dict[int, int]  # pid -> rank, until reaped
    start: float
    deadline: float
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    timed_out: list[int] = field(default_factory=list)


def _serve() -> tuple[dict[str, Any], int] | None:
    """Answer requests until stdin closes and all jobs are done (``None``); in a rank, its job."""
    _answer({"ready": True})
    jobs: dict[int, _Running] = {}
    owner: dict[int, int] = {}  # pid -> job id
    buffer, eof = b"", False
    while not eof or jobs:
        if not eof and select.select([0], [], [], 0.02 if jobs else None)[0]:
            chunk = os.read(0, 1 << 16)
            eof = not chunk
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                now = time.monotonic()
                job = jobs[request["id"]] = _Running(request, {}, now, now + request["timeout"])
                for rank in range(request["world"]):
                    pid = os.fork()
                    if pid == 0:
                        return request, rank
                    job.pids[pid] = rank
                    owner[pid] = request["id"]
        elif eof:
            time.sleep(0.02)
        _reap(jobs, owner)
        for job_id in [i for i, job in jobs.items() if not job.pids]:
            job = jobs.pop(job_id)
            wall = time.monotonic() - job.start
            _answer({"id": job_id, "ranks": job.ranks, "timed_out": sorted(job.timed_out), "wall_s": wall})
    return None


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _reap(jobs: dict[int, _Running], owner: dict[int, int]) -> None:
    """Collect the ranks that exited; end the stopped (when asked) and the overdue ones."""
    while owner:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            break
        if pid not in owner:
            continue
        job = jobs[owner.pop(pid)]
        rank = job.pids.pop(pid)
        cpu = usage.ru_utime + usage.ru_stime
        job.ranks[rank] = {"pid": pid, "returncode": _returncode(status), "exit_time": time.time(), "cpu_s": cpu}
    for job in jobs.values():
        if job.pids and job.request.get("kill_stopped") and all(_stopped(p) for p in job.pids):
            for pid in job.pids:
                os.kill(pid, signal.SIGKILL)  # only the stopped are left: end them
        elif job.pids and time.monotonic() > job.deadline:
            for pid, rank in job.pids.items():
                os.kill(pid, signal.SIGKILL)  # our own child, past its job's timeout
                job.timed_out.append(rank)
            job.deadline = float("inf")


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _become_rank(request: dict[str, Any], rank: int) -> Any:
    """In the forked child: the rank's output, environment and target."""
    log_dir = Path(request["log_dir"])
    fd = os.open(log_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the rank's stdin for its whole life)
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in request["env"].items()})
    module_name, _, fn_name = request["target"].partition(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    return fn(rank, request["world"], **request["kwargs"])


if __name__ == "__main__":
    for name in sys.argv[1:]:
        importlib.import_module(name)
    # What the zygote imported stays out of every garbage collection, the ranks' included: a
    # forked rank's full collection at exit would otherwise touch (and copy-on-write) every page
    # of torch's and Lightning's objects, seconds per exit on a loaded machine.
    gc.freeze()
    job = _serve()
    if job is not None:
        _become_rank(*job)  # a rank: from here on an ordinary script (traceback + exit 1 on error)
