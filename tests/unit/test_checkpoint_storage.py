"""A full disk or a read-only target during save_state (synchronous and asynchronous): one OSError naming the
directory given (never impel's hidden temporary one), the bytes needed and free; the previous checkpoint survives
and loads, nothing half-written is left. The disk is filled by patching (portable) and, where this process may
mount a small tmpfs (root), for real."""
from __future__ import annotations

import errno
import os
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from impel import Accelerator
from impel.checkpoint import CheckpointError
from impel.checkpoint.io import direct_io
from impel.checkpoint.store import storage

Usage = namedtuple("Usage", "total used free")


def _run(hidden: int = 32):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    return acc, model, opt


def _save(acc, target: Path, asynchronous: bool) -> None:
    acc.save_state(str(target), async_save=asynchronous)
    if asynchronous:
        acc.wait_for_checkpoint()


def _expect_failure(acc, target: Path, asynchronous: bool, at_call: bool = False) -> str:
    """The message the failed save shows: raised by the call (a synchronous save, or a check before anything is
    written), or by the wait for an asynchronous save, which names the directory too."""
    if not asynchronous or at_call:
        with pytest.raises(OSError) as info:
            _save(acc, target, asynchronous)
        return f"{type(info.value).__name__}: {info.value}"
    with pytest.raises(CheckpointError) as raised:
        _save(acc, target, asynchronous)
    assert str(raised.value).startswith(f"the asynchronous save_state() to {target} failed: ")
    return str(raised.value)


def _assert_nothing_lost(acc, model, target: Path) -> None:
    """The previous checkpoint is the complete one and loads; no temporary directory is left."""
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    before = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(str(target))
    after = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch, asynchronous):
    acc, model, opt = _run()
    target = tmp_path / "ckpt"
    acc.save_state(str(target))
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    needed = storage.state_bytes([model], [opt])
    assert needed == 4 * 3 * (8 * 32 + 32 + 32 + 1) + 4 * 4  # weights, exp_avg, exp_avg_sq; 4 steps
    message = _expect_failure(acc, target, asynchronous, at_call=True)
    assert message == (f"OSError: [Errno 28] no space left on {target}: the checkpoint needs {needed:,} bytes "
                            "(at least), 1,000 free; free space on that filesystem or save_state to another one "
                            "(the previous checkpoint there, if any, is kept)"), message
    monkeypatch.undo()
    _assert_nothing_lost(acc, model, target)


def test_the_room_asked_for_grows_with_the_optimizer_states(tmp_path, monkeypatch):
    """The bytes a save asks for are kept between saves (their sum walks every module) but not past the optimizer's
    first step, which adds its states."""
    acc = Accelerator(cpu=True)
    model = nn.Linear(8, 32)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    weights = storage.state_bytes([model], [opt])
    acc.save_state(str(tmp_path / "before"))  # no optimizer state yet: the weights only
    acc.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    needed = storage.state_bytes([model], [opt])
    assert needed > 3 * weights
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 2 * weights, 2 * weights))
    message = _expect_failure(acc, tmp_path / "after", asynchronous=False)
    assert f"the checkpoint needs {needed:,} bytes (at least), {2 * weights:,} free" in message, message


def _full_after(monkeypatch, limit: int) -> None:
    """The disk fills up after ``limit`` bytes of any checkpoint file impel streams (torch.save's, safetensors,
    DCP shards): the I/O thread's ``pwrite`` fails with ENOSPC, as on a real full disk."""
    real = direct_io.DirectFile._write

    def write(self, buffer, at, size):
        if at + size > limit:
            with self._idle:  # what the real write's finally does: the buffer goes back
                self._ready.append(buffer)
                self._idle.notify()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, buffer, at, size)

    monkeypatch.setattr(direct_io.DirectFile, "_write", write)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_disk_that_fills_up_while_writing_names_the_target(tmp_path, monkeypatch, asynchronous):
    acc, model, opt = _run()
    target = tmp_path / "ckpt"
    acc.save_state(str(target))
    _full_after(monkeypatch, 600)
    message = _expect_failure(acc, target, asynchronous)
    assert f"OSError: [Errno 28] no space left on {target}: the checkpoint needs " in message, message
    assert ".impel-tmp" not in message and "inline_container" not in message
    monkeypatch.undo()
    _assert_nothing_lost(acc, model, target)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_read_only_filesystem_met_while_writing_names_the_target(tmp_path, monkeypatch, asynchronous):
    acc, model, _ = _run()
    target = tmp_path / "ckpt"
    acc.save_state(str(target))

    def refuse(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(direct_io, "open_direct", refuse)
    message = _expect_failure(acc, target, asynchronous)
    assert f"OSError: [Errno 30] {target} is read-only ({tmp_path}: Read-only file system); save_state needs to " \
           "write there" in message, message
    assert ".impel-tmp" not in message
    monkeypatch.undo()
    _assert_nothing_lost(acc, model, target)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write into: chmod 555, or (as root, whom modes do not stop) a read-only
    tmpfs mounted there."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o555)
        yield where
        where.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("root cannot mount a read-only tmpfs here, and modes do not stop root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_read_only_directory_is_named_before_anything_is_written(read_only_dir):
    acc, _, _ = _run()
    for target in (read_only_dir / "ckpt", read_only_dir / "runs" / "ckpt"):
        with pytest.raises(OSError) as info:
            acc.save_state(str(target))
        assert str(info.value).startswith(f"[Errno {info.value.errno}] {target} is read-only ({read_only_dir}: ")
        assert info.value.errno in (errno.EROFS, errno.EACCES)
    assert list(read_only_dir.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A real 20 MB filesystem (tmpfs; needs root)."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_real_full_disk(small_disk, asynchronous):
    acc, model, opt = _run(hidden=100_000)  # 12 MB of weights and AdamW state: one checkpoint fits, two do not
    target = small_disk / "ckpt"
    acc.save_state(str(target))
    message = _expect_failure(acc, target, asynchronous, at_call=True)
    assert f"OSError: [Errno 28] no space left on {target}: the checkpoint needs " \
           f"{storage.state_bytes([model], [opt]):,} bytes (at least), " in message, message
    _assert_nothing_lost(acc, model, target)


def test_a_directory_without_write_permission_is_named_not_the_hidden_temp_dir(tmp_path, monkeypatch):
    """What a chmod 555 directory gives a user who is not root (root ignores modes): mkdir raises EACCES."""
    from pathlib import Path as RealPath

    acc, model, _ = _run()
    target = tmp_path / "ckpt"
    acc.save_state(str(target))
    real = RealPath.mkdir

    def refuse(self, *args, **kwargs):
        if self.name.startswith(".impel-tmp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RealPath, "mkdir", refuse)
    with pytest.raises(OSError) as info:
        acc.save_state(str(target))
    assert str(info.value).startswith(f"[Errno 13] {target} is read-only ({tmp_path}: Permission denied); "
                                      "save_state needs to write there")
    monkeypatch.undo()
    _assert_nothing_lost(acc, model, target)
