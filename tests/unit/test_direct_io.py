"""The checkpoint file writer around the page cache (checkpoint/io/direct_io.py): the bytes on disk are the bytes
written, whatever the sizes of the pieces, with O_DIRECT, through the page cache where the file system refuses
O_DIRECT (at open or at the first write), and for a file several writers fill at unaligned offsets; a failed write
raises in the caller and leaves no thread or descriptor behind."""
from __future__ import annotations

import errno
import os
import random
import threading

import pytest

from impel.checkpoint.io import direct_io
from impel.checkpoint.io.direct_io import BUFFER, PAGE, DirectFile

SIZES = [0, 1, PAGE - 1, PAGE, BUFFER - 3, BUFFER, BUFFER + 7, 3 * BUFFER + 12345]


def _pieces(data: bytes, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    view, out, at = memoryview(data), [], 0
    while at < len(data):
        n = rng.choice([1, 7, 4096, 100_000, 3 << 20, BUFFER + 1])
        out.append(view[at:at + n])
        at += n
    return out


@pytest.mark.parametrize("size", SIZES)
def test_appended_bytes_are_the_file(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    file = DirectFile(path)
    for piece in _pieces(data, size):
        assert file.write(piece) == piece.nbytes
    assert file.tell() == size
    file.finish()
    assert path.read_bytes() == data
    assert path.stat().st_blocks * 512 <= size + (1 << 20)  # the space reserved ahead was given back
    assert not any(t.name.startswith("impel-write") for t in threading.enumerate())


def test_a_reserve_that_failed_part_way_is_cut_back_to_the_files_bytes(tmp_path, monkeypatch):
    """``fallocate`` can fail (ENOSPC) after lengthening the file: the finished file still has exactly its bytes
    (a file left longer than its manifest entry would fail every load)."""
    def partial(fd, offset, length):
        os.ftruncate(fd, offset + length)  # what a reserve that gave up part way can leave
        return False

    monkeypatch.setattr(direct_io, "_fallocate", partial)
    path = tmp_path / "f.bin"
    data = os.urandom(2 * BUFFER + PAGE)  # ends on a page: no padded last write to truncate anyway
    file = DirectFile(path)
    file.write(data)
    file.finish()
    assert path.stat().st_size == len(data) and path.read_bytes() == data


def test_o_direct_is_used_where_the_file_system_takes_it(tmp_path):
    """On Linux ext4/xfs (this project's machines) the flag is taken; elsewhere the buffered path is the writer. A
    file shorter than ``SMALL`` goes through the page cache at the end (one write, no padding, no truncate)."""
    file, small = DirectFile(tmp_path / "f.bin"), DirectFile(tmp_path / "small.bin")
    data = os.urandom(direct_io.SMALL + 5)
    file.write(data)
    small.write(data[:direct_io.SMALL - 1])
    file.finish()
    small.finish()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert (tmp_path / "small.bin").read_bytes() == data[:direct_io.SMALL - 1]
    assert not small.direct
    if hasattr(os, "O_DIRECT") and os.uname().sysname == "Linux":
        probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        os.close(probe)
        assert file.direct


def test_without_o_direct_the_page_cache_writes_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "_DIRECT", 0)
    data = os.urandom(2 * BUFFER + 999)
    file = DirectFile(tmp_path / "f.bin")
    assert not file.direct
    for piece in _pieces(data, 1):
        file.write(piece)
    file.finish()
    assert (tmp_path / "f.bin").read_bytes() == data


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    """Some file systems take O_DIRECT at open and fail the writes with EINVAL: the file switches to the page
    cache and still holds every byte."""
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    data = os.urandom(BUFFER + 5000)
    file = DirectFile(tmp_path / "f.bin")
    file.write(data)
    file.finish()
    assert (tmp_path / "f.bin").read_bytes() == data
    if hasattr(os, "O_DIRECT"):
        assert refused and not file.direct


def test_two_writers_fill_one_file_at_unaligned_offsets(tmp_path):
    """The cooperative full files: ranges of any length at any offset, neighbours sharing pages, two writers."""
    rng = random.Random(0)
    total = 5 * BUFFER + 777
    cuts = sorted(rng.sample(range(1, total), 40) + [PAGE, 2 * PAGE + 1, BUFFER])
    bounds = list(zip([0, *cuts], [*cuts, total]))
    data = os.urandom(total)
    path = tmp_path / "shared.bin"
    files = [DirectFile(path, shared=True) for _ in range(2)]
    os.ftruncate(files[0].fileno(), total)

    def fill(who: int) -> None:
        for i, (lo, hi) in enumerate(bounds):
            if i % 2 == who:
                files[who].write_at(lo, memoryview(data)[lo:hi])
        files[who].finish()

    threads = [threading.Thread(target=fill, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() == data


def test_a_failed_write_raises_in_the_caller_and_closes_the_file(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "pwrite", full)
    file = DirectFile(tmp_path / "f.bin")
    with pytest.raises(OSError, match="No space left"):
        for _ in range(2 * direct_io.DEPTH + 2):  # the I/O thread's failure reaches a later write
            file.write(bytes(BUFFER))
        file.finish()
    file.abort()
    with pytest.raises(OSError):
        os.fstat(file.fd)  # closed
    assert not any(t.name.startswith("impel-write") for t in threading.enumerate())
