"""AtomicCheckpointIO: a save that fails or is killed mid-write leaves the last good checkpoint
in place and loadable; our strategies use it unless the user gives a CheckpointIO."""

from __future__ import annotations

import io
import os
import pickle
import re
import signal
import stat
import struct
import time
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

import lightning_strategies  # noqa: F401  (registers the names)
from lightning_strategies import ParameterServerStrategy, PipelineStrategy, RingAllReduceStrategy
from lightning_strategies.checkpoint import AtomicCheckpointIO, CorruptCheckpointError, temp_files_of

OURS = ("ring", "ring_bf16", "ps", "parameter_server", "ps_fork", "pipeline", "async")


def _ckpt(value: float, numel: int = 1000) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((numel,), value)}, "global_step": int(value)}


def _write_half(real_save: Any, obj: Any, f: Any) -> None:
    buf = io.BytesIO()
    real_save(obj, buf)
    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
    f.flush()


@pytest.fixture
def patch_save(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make ``torch.save`` write the first half of the real bytes, then raise the given error."""
    real = torch.save

    def install(exc: BaseException) -> None:
        def fake_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            _write_half(real, obj, f)
            raise exc

        monkeypatch.setattr(torch, "save", fake_save)

    return install


def _assert_holds(path: Path, value: float) -> None:
    loaded = AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert loaded["global_step"] == int(value)
    torch.testing.assert_close(loaded["state_dict"]["w"], _ckpt(value)["state_dict"]["w"])


def test_save_load_roundtrip_leaves_only_the_target(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "last.ckpt"  # directory created on demand
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    AtomicCheckpointIO().save_checkpoint(_ckpt(2.0), target)  # overwrite
    _assert_holds(target, 2.0)
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_new_file_gets_the_same_permissions_as_a_plain_open(tmp_path: Path) -> None:
    target, plain = tmp_path / "a.ckpt", tmp_path / "plain"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    plain.write_bytes(b"")  # mode 0o666 minus the umask, as TorchCheckpointIO's files get
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_save_keeps_the_previous_checkpoint_and_no_temp_file(
    tmp_path: Path, patch_save: Any, exc: BaseException
) -> None:
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    patch_save(exc)
    with pytest.raises(type(exc)):
        AtomicCheckpointIO().save_checkpoint(_ckpt(2.0), target)
    _assert_holds(target, 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_half_a_checkpoint_does_not_load(tmp_path: Path) -> None:
    # What the tests above guard against: the truncated stream they write is not a checkpoint.
    half = tmp_path / "half.ckpt"
    with half.open("wb") as f:
        _write_half(torch.save, _ckpt(2.0), f)
    with pytest.raises(Exception):  # noqa: B017 - torch raises RuntimeError or EOFError by version
        torch.load(half, weights_only=True)


def test_data_is_fsynced_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "a.ckpt")
    assert calls[:2] == ["fsync", "replace"], calls  # the file's data, then the rename (then the directory)


def _killed_writer(target: str, ready: str) -> None:
    real = torch.save

    def stall_half_way(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        _write_half(real, obj, f)
        Path(ready).write_text("half written\n")
        time.sleep(60)  # the parent SIGKILLs us here, mid-write

    torch.save = stall_half_way  # type: ignore[assignment]  # forked child: patched here only
    AtomicCheckpointIO().save_checkpoint(_ckpt(2.0, numel=200_000), target)


def test_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    target, ready = tmp_path / "last.ckpt", tmp_path / "ready"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    proc = mp.get_context("fork").Process(target=_killed_writer, args=(str(target), str(ready)), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.is_alive() and time.monotonic() < deadline, f"writer exited early: {proc.exitcode}"
            time.sleep(0.05)
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    _assert_holds(target, 1.0)
    leftovers = temp_files_of(target)
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # killed: it could not clean up
    assert not leftovers[0].name.endswith(".ckpt")  # so ModelCheckpoint's "last"/top-k never pick it
    AtomicCheckpointIO().save_checkpoint(_ckpt(3.0), target)  # the next good save removes it
    _assert_holds(target, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "ready"]


def test_storage_options_are_rejected_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"storage_options=.*expected None.*Fix"):
        AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "a.ckpt", storage_options={"x": 1})


def test_remote_paths_use_the_fsspec_transaction_of_torch_checkpoint_io() -> None:
    path = "memory://lightning-strategies-test/a.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(4.0), path)
    loaded = AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert loaded["global_step"] == 4
    AtomicCheckpointIO().remove_checkpoint(path)


# -- the strategies' default -------------------------------------------------------------------


def _io(strategy: Any, **trainer_kwargs: Any) -> Any:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **trainer_kwargs)
    return trainer.strategy.checkpoint_io


@pytest.mark.parametrize("name", OURS)
def test_our_strategies_write_atomically_by_default(name: str) -> None:
    assert type(_io(name)) is AtomicCheckpointIO


@pytest.mark.parametrize("name", OURS)
def test_a_checkpoint_io_plugin_still_wins(name: str) -> None:
    mine = TorchCheckpointIO()
    assert _io(name, plugins=[mine]) is mine


@pytest.mark.parametrize("cls", [RingAllReduceStrategy, ParameterServerStrategy, PipelineStrategy])
def test_strategy_instance_with_a_plugin_is_not_a_conflict(cls: type) -> None:
    # The default is filled in lazily: Lightning refuses an instance that already holds a
    # CheckpointIO when plugins also give one ("set through both strategy class and plugins").
    mine = TorchCheckpointIO()
    assert _io(cls(), plugins=[mine]) is mine
    given = TorchCheckpointIO()
    assert _io(cls(checkpoint_io=given)) is given


def test_a_wrapping_plugin_without_a_base_wraps_the_atomic_io() -> None:
    wrapper = _io("ring", plugins=[AsyncCheckpointIO()])
    assert isinstance(wrapper, AsyncCheckpointIO)
    assert type(wrapper.checkpoint_io) is AtomicCheckpointIO


def test_lightning_strategies_are_left_alone() -> None:
    assert type(_io("ddp")) is TorchCheckpointIO
    assert type(_io(DDPStrategy())) is TorchCheckpointIO


# -- reading a file that is not a whole checkpoint -----------------------------------------------


def _damaged(good: bytes, kind: str) -> bytes:
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "random":
        return bytes(range(256)) * 16  # starts with 0x00: neither a zip nor a legacy torch file
    if kind == "empty":
        return b""
    # "bitflip": one byte in the middle of the pickled data member (after its local header)
    with zipfile.ZipFile(io.BytesIO(good)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    name_len, extra_len = struct.unpack("<HH", good[info.header_offset + 26 : info.header_offset + 30])
    flipped = bytearray(good)
    flipped[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF
    return bytes(flipped)


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("truncated", r"it is truncated \(\d+ bytes: a zip archive without its end"),
        ("random", r"it is not a checkpoint: 4096 bytes that do not start like a zip archive"),
        ("empty", r"the file is empty \(0 bytes\)"),
        ("bitflip", r"it is damaged \(\d+ bytes; the member '.*data\.pkl' fails its CRC check\)"),
    ],
)
def test_a_damaged_file_names_path_problem_and_whole_neighbours(tmp_path: Path, kind: str, problem: str) -> None:
    good = tmp_path / "epoch=0.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), good)
    (tmp_path / "half.ckpt").write_bytes(good.read_bytes()[:100])  # not whole: not offered instead
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(_damaged(good.read_bytes(), kind))
    for weights_only in (None, True):
        with pytest.raises(CorruptCheckpointError) as err:
            AtomicCheckpointIO().load_checkpoint(bad, weights_only=weights_only)
        text = str(err.value)
        assert re.search(problem, text), text
        assert f"Cannot resume from checkpoint '{bad}'" in text and "Expected a whole checkpoint" in text
        assert f"Fix: pass another checkpoint as ckpt_path (whole ones in its folder, newest first: {good})" in text
        assert err.value.path == str(bad) and re.search(problem, err.value.problem)
        assert err.value.__cause__ is not None  # torch.load's own error, chained


class _NotAllowed:
    """A class ``torch.load(weights_only=True)`` refuses: the file is sound, the policy says no."""


def test_errors_about_a_sound_file_pass_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "custom.ckpt"
    AtomicCheckpointIO().save_checkpoint({"obj": _NotAllowed()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global") as err:
        AtomicCheckpointIO().load_checkpoint(path, weights_only=True)
    assert not isinstance(err.value, CorruptCheckpointError)
    assert isinstance(AtomicCheckpointIO().load_checkpoint(path, weights_only=False)["obj"], _NotAllowed)
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")
