"""Checked reads ask the kernel for the bytes ahead of them (``verified.VerifyingReader``, posix_fadvise WILLNEED):
a cold load otherwise waits for each request in turn while the disk idles. The window runs ahead of every read,
starts again where a reader jumps (a zip's directory first, then its records), and a reader that reads only some
ranges (a rank's shards of a full file) asks for those only. The bytes read and their check are unchanged."""
from __future__ import annotations

import os

import pytest

from impel.checkpoint.io import hashing, verified
from impel.checkpoint.store import layout

pytestmark = pytest.mark.skipif(verified._WILLNEED is None, reason="no posix_fadvise on this platform")
AHEAD = 1 << 20


@pytest.fixture
def reader(tmp_path, monkeypatch):
    """A checked reader of a 3.5 MiB file (the window shrunk to 1 MiB) and the ranges it asked for."""
    monkeypatch.setattr(verified, "AHEAD", AHEAD)
    data = os.urandom(3 * AHEAD + AHEAD // 2)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    asked: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == verified._WILLNEED:
            asked.append((offset, offset + length))
        return fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    entry = layout.build_manifest(tmp_path)["f.bin"]
    made = verified.VerifyingReader(path, entry, hashing.BLOCK)
    yield made, asked, data
    made.close()


def _asked_up_to(asked: list[tuple[int, int]], position: int) -> int:
    """The end of the asked bytes that run on without a gap from ``position``."""
    end = position
    for lo, hi in sorted(asked):
        if lo <= end < hi:
            end = hi
    return end


def test_a_sequential_read_keeps_a_window_asked_ahead_of_it(reader):
    made, asked, data = reader
    got, reads = bytearray(), []
    while len(got) < len(data):
        start = len(got)
        got += made.read(100_000)  # one readinto
        reads.append((start, _asked_up_to(asked, start)))  # asked for by the time this read was made
    assert bytes(got) == data
    made.check()  # the check is unchanged
    assert all(end >= min(len(data), start + AHEAD // 2) for start, end in reads)
    assert all(0 <= lo < hi <= len(data) for lo, hi in asked)


def test_a_reader_that_jumps_back_gets_a_new_window_where_it_reads(reader):
    made, asked, data = reader
    made.seek(len(data) - 100)
    assert made.read(100) == data[-100:]  # a zip reader: the directory at the end first
    made.seek(0)
    assert made.read(1000) == data[:1000]
    assert _asked_up_to(asked, 0) >= AHEAD // 2
    assert all(hi - lo <= AHEAD for lo, hi in asked)  # never more than a window at once


def test_a_reader_of_some_ranges_asks_for_those_only(reader):
    made, asked, data = reader
    wanted = [(AHEAD + 5000, AHEAD + 9000), (10, 70_000), (2 * AHEAD, 2 * AHEAD + 300_000)]
    made.plan(wanted)
    for lo, hi in sorted(wanted):
        made.seek(lo)
        assert made.read(hi - lo) == data[lo:hi]
    assert asked and all(any(a <= lo and hi <= b for a, b in wanted) for lo, hi in asked)
    assert all(_asked_up_to(asked, lo) >= hi for lo, hi in wanted)  # every planned byte was asked for
