"""The runs a rank writes for its box of a tensor (checkpoint/formats/cooperative.py) are exactly the box's bytes, at
the box's places in the row-major file: checked against numpy indexing on every box shape FSDP (dim 0), tensor
parallel (dim 1) and both together produce, including empty boxes and 0-d tensors; and a full file written under a
save is finished in the background, its failures raised by the save's digests."""
from __future__ import annotations

import math

import numpy as np
import pytest

from impel.checkpoint.formats.cooperative import optimizer_state_from, optimizer_tensors, runs


@pytest.mark.parametrize("shape, offsets, sizes", [
    ((10, 4), (0, 0), (10, 4)),  # the whole tensor: one run
    ((10, 4), (6, 0), (4, 4)),  # FSDP: rows
    ((10, 4), (0, 2), (10, 2)),  # tensor parallel rowwise: a column block, one run per row
    ((6, 8), (3, 4), (3, 4)),  # both
    ((2, 3, 4), (1, 1, 0), (1, 2, 4)),  # 3-d, whole last dim
    ((2, 3, 4), (0, 1, 1), (2, 2, 2)),  # 3-d, partial everywhere
    ((7,), (4,), (3,)),
    ((10, 4), (10, 0), (0, 4)),  # an empty shard (FSDP's last rank with fewer rows than ranks)
    ((), (), ()),  # a 0-d tensor (an optimizer's step)
])
def test_runs_cover_exactly_the_box(shape, offsets, sizes):
    full = np.arange(math.prod(shape)).reshape(shape)
    box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
    out = np.full(math.prod(shape), -1)
    for at, local_at, count in runs(shape, offsets, sizes):
        out[at:at + count] = box[local_at:local_at + count]
    expected = np.full(math.prod(shape), -1)
    expected.reshape(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = \
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert (out == expected).all()
    assert sum(count for _, _, count in runs(shape, offsets, sizes)) == math.prod(sizes)


def test_optimizer_state_round_trips_through_tensors_and_json():
    import torch

    state = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "params": ["w"],
                               "foreach": None}]}
    tensors, metadata = optimizer_tensors(state)
    back = optimizer_state_from(tensors, metadata)
    assert back["param_groups"] == state["param_groups"]  # the tuple stays a tuple
    assert back["state"]["w"]["step"].item() == 3.0 and back["state"]["w"]["exp_avg"].tolist() == [1.0, 1.0]
    assert optimizer_tensors({"state": {"w": {"momentum": [1]}}, "param_groups": []}) is None  # gathered instead
    assert optimizer_tensors({"state": {}, "param_groups": [{"f": object()}]}) is None


def _tensors():
    import torch

    torch.manual_seed(0)
    return {"a": torch.randn(300, 70), "b": torch.arange(11, dtype=torch.int64), "c": torch.randn(5)}


def test_a_full_file_written_under_a_save_is_finished_in_the_background_and_its_ranges_recorded(tmp_path):
    """During a save (``SaveSession.sealing``) the last writes and the fsync of a cooperative file go on after
    ``write`` returns;
    ``entries()`` waits for them and gives the file's entry from the ranges hashed as they were written."""
    from safetensors.torch import load_file

    from impel.checkpoint.formats import cooperative
    from impel.checkpoint.io import digests, hashing
    from impel.checkpoint.saving.session import SaveSession
    from impel.checkpoint.store import layout

    tensors = _tensors()
    session = SaveSession(tmp_path)
    with session.sealing() as sealer:
        cooperative.write(session, tensors, tmp_path / "model.safetensors", {}, rank=0)
        entry = digests.join_ranges([sealer.entries()])["model.safetensors"]
    path = tmp_path / "model.safetensors"
    assert entry["size"] == path.stat().st_size
    ends = layout.entry_ends(entry)
    assert ends is not None and ends[-1] == entry["size"]
    assert entry[hashing.WRITTEN_KEY] == hashing.file_digests([path], ends={path: ends})[0]
    loaded = load_file(path)
    assert all((loaded[k] == v).all() for k, v in tensors.items())


def test_a_background_write_failure_of_a_full_file_raises_from_the_saves_digests(tmp_path, monkeypatch):
    import errno

    from impel.checkpoint.formats import cooperative
    from impel.checkpoint.io import direct_io
    from impel.checkpoint.saving.session import SaveSession

    def full(self, buffer, at, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    session = SaveSession(tmp_path)
    with session.sealing() as sealer:
        monkeypatch.setattr(direct_io.DirectFile, "_write", full)
        cooperative.write(session, _tensors(), tmp_path / "model.safetensors", {}, rank=0)  # queued: no error yet
        with pytest.raises(OSError, match="No space left"):
            sealer.entries()


def test_every_full_file_of_a_save_is_reserved_before_the_first_write(tmp_path, monkeypatch):
    """``write_files`` (a save's model and optimizer files): both lengths are set before the first byte is written
    (a reserve made while another file's writes and fsync are in flight waits for the journal), and both files
    hold their tensors."""
    import torch
    from safetensors.torch import load_file

    from impel.checkpoint.formats import cooperative
    from impel.checkpoint.io import direct_io
    from impel.checkpoint.saving.session import SaveSession

    torch.manual_seed(1)
    other = {"m": torch.randn(64, 129), "v": torch.randn(64, 129)}
    paths = [tmp_path / "model.safetensors", tmp_path / "optimizer.safetensors"]
    at_first_write: list[dict[str, int]] = []
    write_at = direct_io.DirectFile.write_at

    def spy(self, offset, data):
        if not at_first_write:
            at_first_write.append({p.name: p.stat().st_size if p.exists() else -1 for p in paths})
        return write_at(self, offset, data)

    monkeypatch.setattr(direct_io.DirectFile, "write_at", spy)
    cooperative.write_files(SaveSession.plain(), [(_tensors(), paths[0], {}), (other, paths[1], {"k": "v"})], rank=0)
    assert at_first_write == [{p.name: p.stat().st_size for p in paths}]
    for path, tensors in zip(paths, (_tensors(), other)):
        loaded = load_file(path)
        assert sorted(loaded) == sorted(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_failed_full_file_write_closes_the_files_it_opened(tmp_path, monkeypatch):
    import errno
    import os

    from impel.checkpoint.formats import cooperative
    from impel.checkpoint.io import direct_io
    from impel.checkpoint.saving.session import SaveSession

    def full(self, buffer, at, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(direct_io.DirectFile, "_write", full)
    files = [(_tensors(), tmp_path / "model.safetensors", {}), (_tensors(), tmp_path / "optimizer.safetensors", {})]
    with pytest.raises(OSError, match="No space left"):
        cooperative.write_files(SaveSession.plain(), files, rank=0)
    assert len(os.listdir("/proc/self/fd")) == before
