"""Checkpoint files that are either the old one or the new one, never half of the new one.

A run killed while it writes ``last.ckpt`` (a preempted node, an OOM kill, a ``torchrun --max-restarts`` restart)
must find the previous ``last.ckpt`` intact when it resumes. Every strategy of this package uses
:class:`AtomicCheckpointIO` unless the user gives a ``CheckpointIO`` (their ``checkpoint_io`` property is
:data:`ATOMIC_CHECKPOINT_IO_DEFAULT`); for another strategy, pass ``Trainer(plugins=[AtomicCheckpointIO()])``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

__all__ = ["ATOMIC_CHECKPOINT_IO_DEFAULT", "AtomicCheckpointIO", "CorruptCheckpointError", "temp_files_of"]

_TEMP_SUFFIX = ".tmp"
_ZIP_MAGIC = b"PK\x03\x04"  # a zip archive's first local file header: how torch.save's files start
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9"  # pickle of torch's pre-1.6 magic number


def _temp_prefix(target: Path) -> str:
    # Hidden and not ending in ".ckpt": ModelCheckpoint's "last"/top-k searches never see it.
    return f".{target.name}."


def temp_files_of(target: _PATH) -> list[Path]:
    """The temporary files that writers of ``target`` (a ``save_checkpoint`` path) killed mid-write left, sorted."""
    path = Path(os.fspath(target))
    if not path.parent.is_dir():
        return []
    prefix = _temp_prefix(path)
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.name.endswith(_TEMP_SUFFIX))


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that exists but is not a whole checkpoint (empty, truncated, not one at all).

    Attributes:
        path: the file, as given to ``load_checkpoint``.
        problem: what is wrong with it, in words ("the file is empty (0 bytes)", ...).
    """

    def __init__(self, message: str, *, path: str, problem: str) -> None:
        super().__init__(message)
        self.path = path
        self.problem = problem


def _diagnose(fs: Any, path: str) -> str | None:
    """What makes ``path`` unreadable as a checkpoint (a zip archive), or None when it looks sound."""
    try:
        size = int(fs.size(path))
        with fs.open(path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
            if size == 0:
                return "the file is empty (0 bytes)"
            if head.startswith(_LEGACY_MAGIC):
                return None  # torch's pre-1.6 format: not diagnosed, torch's own error stands
            if not head.startswith(_ZIP_MAGIC):
                return (
                    f"it is not a checkpoint: {size} bytes that do not start like a zip archive (torch.save "
                    "writes one), e.g. random bytes, a text file or another format"
                )
            f.seek(0)
            if not zipfile.is_zipfile(f):
                return f"it is truncated ({size} bytes: a zip archive without its end, the central directory)"
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()  # reads every member: only on this error path
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        return f"it is damaged ({size} bytes; the zip archive cannot be read: {err})"
    except OSError:
        return None
    if bad is not None:
        return f"it is damaged ({size} bytes; the member {bad!r} fails its CRC check)"
    return None


def _siblings(path: str) -> list[str]:
    """Up to three ``*.ckpt`` files beside ``path`` with a zip central directory (a cheap read), newest first."""
    target = Path(path)
    try:
        found = [p for p in target.parent.glob("*.ckpt") if p.name != target.name and p.is_file()]
        found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    return [str(p) for p in found if zipfile.is_zipfile(p)][:3]


def _fsync_directory(directory: Path) -> None:
    # Makes the rename durable. Not possible everywhere (Windows cannot open a directory):
    # the rename is still atomic there, only not flushed.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes replace the target atomically and durably.

    A save writes ``.<name>.<pid>-<random>.tmp`` beside the target, ``fsync``\\ s it, renames it over the target
    (``os.replace``) and ``fsync``\\ s the directory; on an error before the rename the target keeps the previous
    checkpoint. A process killed mid-write leaves its temporary file, which the next save of that path removes.
    Remote paths (``s3://``, ...), removing and loading are ``TorchCheckpointIO``'s, except that loading a file that
    is not a whole checkpoint raises :class:`CorruptCheckpointError`.
    """

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable[..., Any] | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``TorchCheckpointIO.load_checkpoint`` (``map_location``, ``weights_only`` as for ``torch.load``).

        A failed ``torch.load`` is diagnosed from the file's bytes; an error on a sound archive (a ``weights_only``
        refusal, a missing device) is re-raised as it was.

        Raises:
            FileNotFoundError: if ``path`` does not exist.
            CorruptCheckpointError: if ``path`` is empty, truncated or not a checkpoint; the message
                names the path, what is wrong and the other checkpoints in its folder.
        """
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (FileNotFoundError, MemoryError):
            raise
        except Exception as err:
            fs, local = url_to_fs(str(path))
            problem = _diagnose(fs, local)
            if problem is None:
                raise  # a sound archive: the error is not about the file's bytes
            others = _siblings(local) if isinstance(fs, LocalFileSystem) else []
            instead = f" (whole ones in its folder, newest first: {', '.join(others)})" if others else ""
            said = str(err).split(". ")[0].splitlines()[0] if str(err).strip() else "(no message)"
            raise CorruptCheckpointError(
                f"Cannot resume from checkpoint {str(path)!r}: {problem}; torch.load raised "
                f"{type(err).__name__}: {said}. Expected a whole "
                "checkpoint as Trainer.save_checkpoint writes it. Fix: pass another checkpoint as ckpt_path"
                f"{instead}, copy the file again if it was transferred, or start without ckpt_path.",
                path=str(path),
                problem=problem,
            ) from err

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` (its directory created when missing), never leaving a partial file there.

        Raises:
            TypeError: if ``storage_options`` is given (not supported, as for ``TorchCheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint got storage_options={storage_options!r}; expected None "
                "(local files take no storage options). Fix: drop the argument, or pass a CheckpointIO plugin "
                "that defines storage options."
            )
        fs, local = url_to_fs(str(path))
        if not isinstance(fs, LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        target = Path(local)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f"{_temp_prefix(target)}{os.getpid()}-{uuid.uuid4().hex[:8]}{_TEMP_SUFFIX}"
        # O_EXCL: a fresh file of our own; mode 0o666 so the umask applies as for a plain open().
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                # Data on disk before the rename: otherwise a crash soon after could leave the
                # new name pointing at an empty or partial file on some file systems (ext4, xfs).
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        _fsync_directory(target.parent)
        for leftover in temp_files_of(target):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _checkpoint_io_or_atomic(self: Strategy) -> CheckpointIO:
    # Filled in lazily (not in __init__) so that Trainer(strategy=<instance>, plugins=[<io>]) stays valid:
    # Lightning rejects a strategy instance that already holds a CheckpointIO when plugins give one too.
    io = self._checkpoint_io
    if io is None:
        io = self._checkpoint_io = AtomicCheckpointIO()
    elif isinstance(io, _WrappingCheckpointIO) and not io._base_checkpoint_io_configured:
        io.checkpoint_io = AtomicCheckpointIO()  # e.g. AsyncCheckpointIO() given without a base
    return io


def _set_checkpoint_io(self: Strategy, io: CheckpointIO) -> None:
    self._checkpoint_io = io


ATOMIC_CHECKPOINT_IO_DEFAULT = property(
    _checkpoint_io_or_atomic,
    _set_checkpoint_io,
    doc="The strategy's CheckpointIO: the user's (Trainer plugins or the constructor), else AtomicCheckpointIO.",
)
"""A drop-in for ``Strategy.checkpoint_io`` that defaults to :class:`AtomicCheckpointIO`.

A strategy class opts in with one line, ``checkpoint_io = ATOMIC_CHECKPOINT_IO_DEFAULT``.
"""
