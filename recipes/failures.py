"""One failure, one message: how the app reports an error that stops a single run.

Every rank of a run raises (the config error it hit itself, or "peer rank r stopped on an error:
..." about another), and each would print its traceback: dozens of lines for one message. The app
owns its entry point, so it prints the message once, in the app's own words (``resume=``,
``null``), with the fix, and writes the traceback to the run's log file (Hydra's
``<run dir>/<job name>.log``). ``HYDRA_FULL_ERROR=1`` prints the traceback on the terminal as well,
as Hydra does.

Which rank prints: the first of the run's ranks on this machine to reach the handler (the one that
hit the error; the others fail later, naming it). The ranks Lightning's launcher starts share the
run id the launching process sets (:func:`mark_run`); ranks started by torchrun or SLURM share the
job's id. Without either, rank 0 prints.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

__all__ = ["app_message", "full_error_wanted", "mark_run", "report_failure"]

log = logging.getLogger(__name__)

# The library speaks Python (Trainer(gradient_clip_val=1.0), ckpt_path, None); the app's users write
# Hydra overrides (trainer.gradient_clip_val=1.0, resume=, null). Most specific first.
_APP_WORDS: tuple[tuple[str, str], ...] = (
    (r"\bTrainer\((\w+)=([^()]*)\)", r"trainer.\1=\2"),
    (r"\bpass another checkpoint as ckpt_path\b", "pass another checkpoint as resume=<path to the .ckpt>"),
    (r"\bstart without ckpt_path\b", "start fresh with resume=null"),
    (r"\bckpt_path\b", "resume"),
    (r"\bgradient_clip_val=", "trainer.gradient_clip_val="),
    (r"\btrainer\.trainer\.", "trainer."),
    (r"(\w)=None\b", r"\1=null"),
    (r"(\w)=True\b", r"\1=true"),
    (r"(\w)=False\b", r"\1=false"),
)


def app_message(text: str) -> str:
    """``text`` (a library's error message) with the library's Python names replaced by the app's options."""
    for pattern, replacement in _APP_WORDS:
        text = re.sub(pattern, replacement, text)
    return text


def full_error_wanted() -> bool:
    """Whether the user asked for the whole traceback on the terminal (``HYDRA_FULL_ERROR=1``, as Hydra reads it)."""
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


_RUN_ID = "LIGHTNING_STRATEGIES_APP_RUN"


def mark_run() -> None:
    """Give this run an id that the ranks Lightning starts inherit (they re-run the command with this environment)."""
    os.environ.setdefault(_RUN_ID, uuid.uuid4().hex)


def _run_id() -> str | None:
    for name in (_RUN_ID, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(name):
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
            return f"{os.environ[name]}-{restart}"
    return None


def _first_to_report() -> bool:
    run = _run_id()
    if run is None:
        return int(getattr(rank_zero_only, "rank", 0) or 0) == 0
    marker = Path(tempfile.gettempdir()) / f"lightning-strategies-failed-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}"
    try:  # an exclusive create: of the ranks on this machine exactly one succeeds
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _child_error(text: str) -> str | None:
    """The error at the end of a traceback's text (what torch.multiprocessing's fork/spawn launchers
    raise in the parent, carrying the child's traceback as its message), without the frames."""
    _, found, tail = text.rpartition("Traceback (most recent call last):")
    if not found:
        return None
    lines = tail.splitlines()
    while lines and (not lines[0].strip() or lines[0].startswith((" ", "\t"))):
        lines.pop(0)
    return "\n".join(lines).strip() or None


def _message(err: BaseException) -> str:
    """The error and those of its notes that add something: a peer's note that repeats this rank's own
    message ("peer rank 1 of 2 stopped on an error: <the same>") is dropped."""
    own = _child_error(str(err)) or f"{type(err).__name__}: {err}"
    lines = [line for note in getattr(err, "__notes__", ()) for line in str(note).splitlines()]
    notes = [line for line in lines if not _repeats(line, own)]
    return app_message("\n".join([own, *notes]))


def _repeats(note: str, own: str) -> bool:
    # a peer's reason may be cut short (the store keeps 500 characters): compare the start
    reason = note.partition("stopped on an error: ")[2].strip()
    return bool(reason) and reason[:200] in own


def _log_files() -> list[Path]:
    return [Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def report_failure(err: BaseException) -> None:
    """Write ``err``'s traceback to the log files and, on the first of the run's ranks here to fail, its
    message to stderr."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run failed", (), (type(err), err, err.__traceback__))
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for handler in files:  # the file only: the console handler would print the traceback again
        handler.handle(record)
    if not _first_to_report():
        return
    where = f"traceback in {', '.join(map(str, _log_files()))}; " if files else ""
    sys.stderr.write(f"Error: {_message(err)}\n({where}HYDRA_FULL_ERROR=1 prints it here)\n")
    sys.stderr.flush()
