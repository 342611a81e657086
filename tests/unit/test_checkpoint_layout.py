"""Checkpoint directories: naming, atomic commit, manifest, corruption, cleanup, rotation, ProjectConfiguration."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import xxhash
from torch import nn

from checkpoint_helpers import prepared_mlp
from helpers import make_mlp
from impel import Accelerator, CheckpointError, ConfigError, ProjectConfiguration
from impel.accelerator import save_load as checkpointer
from impel.checkpoint.store import layout
from impel.runtime.ranks.process import ProcessState


def prepared(project_dir=None, total_limit=None, **config):
    return prepared_mlp(project_dir, total_limit, steps=1, **config)


def test_a_committed_checkpoint_has_marker_metadata_and_a_true_manifest(tmp_path):
    acc, _model, _opt = prepared()
    path = acc.save_state(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    assert path == str(ckpt) and (ckpt / layout.MARKER_FILE).is_file()
    meta = json.loads((ckpt / layout.METADATA_FILE).read_text())
    assert set(meta["files"]) == {"model.safetensors", "optimizer.pt", "training_state.pt", "random_states_0.pt"}
    for rel, entry in meta["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"size": len(data), "xxh3_128_blocks": [xxhash.xxh3_128(data).hexdigest()]}
    assert (meta["world_size"], meta["strategy"]["name"], meta["strategy"]["format"]) == (1, "NO", "full")
    assert meta["optimizer_steps"] == [1] and meta["torch_version"] == torch.__version__
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left


def block_digests(data: bytes, block: int) -> list[str]:
    return [xxhash.xxh3_128(data[i:i + block]).hexdigest() for i in range(0, len(data), block)] or [
        xxhash.xxh3_128(b"").hexdigest()]


def test_block_digests_computed_while_writing_match_the_bytes_on_disk(tmp_path, monkeypatch):
    """torch.save's and safetensors' blocks are hashed as they are written, a hook's file at commit: every digest
    must equal a fresh hash of the bytes on disk."""
    from impel.checkpoint.io import hashing

    monkeypatch.setattr(hashing, "BLOCK", 1000)
    acc, _model, _opt = prepared()
    def hook(models, weights, out):
        with open(f"{out}/extra.bin", "wb") as f:
            f.write(b"x" * 2500)

    acc.register_save_state_pre_hook(hook)
    acc.save_state(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / layout.METADATA_FILE).read_text())
    assert "extra.bin" in meta["files"] and meta["format_version"] == 4
    assert len(meta["files"]["optimizer.pt"]["xxh3_128_blocks"]) > 1
    for rel, entry in meta["files"].items():
        data = (tmp_path / "ckpt" / rel).read_bytes()
        assert entry == {"size": len(data), "xxh3_128_blocks": block_digests(data, 1000)}, rel
    acc.load_state(tmp_path / "ckpt")  # verifies every block


def test_a_flipped_byte_is_named_by_its_block(tmp_path, monkeypatch):
    from impel.checkpoint.io import hashing

    monkeypatch.setattr(hashing, "BLOCK", 1000)
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    monkeypatch.setattr(hashing, "BLOCK", 64 << 20)  # verification uses the block size the checkpoint records
    acc.load_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[1500] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted \(bytes 1000-2000 differ"):
        acc.load_state(tmp_path / "ckpt")


def test_a_format_version_1_manifest_still_verifies(tmp_path):
    """Checkpoints written before per-block digests (one sha256 per file) load, and their corruption is caught."""
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    meta = json.loads((ckpt / layout.METADATA_FILE).read_text())
    for rel, entry in meta["files"].items():
        entry.pop("xxh3_128_blocks")
        entry["sha256"] = hashlib.sha256((ckpt / rel).read_bytes()).hexdigest()
    meta["format_version"] = 1
    text = json.dumps(meta)
    (ckpt / layout.METADATA_FILE).write_text(text)
    (ckpt / layout.MARKER_FILE).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    acc.load_state(ckpt)
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is corrupted \(its sha256 differs"):
        acc.load_state(ckpt)


def test_model_file_holds_the_full_state_dict_under_plain_names(tmp_path):
    from safetensors.torch import load_file

    acc, model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    expected = model.state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_fails_the_load_naming_the_file(tmp_path, damage):
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
        # the size alone says it, before any hashing
        why = rf"is truncated or corrupted \({len(data) // 2} bytes, the manifest says {len(data)} bytes\)"
    else:
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        why = r"is corrupted \(bytes \d+-\d+ differ from the manifest's xxh3_128"
    with pytest.raises(CheckpointError, match=rf"optimizer\.pt {why}.*load an earlier checkpoint"):
        acc.load_state(tmp_path / "ckpt")


def test_a_directory_without_marker_is_never_loaded(tmp_path):
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    acc.save_state()
    (tmp_path / "checkpoints" / "checkpoint_1" / layout.MARKER_FILE).unlink()
    assert acc.load_state().endswith("checkpoint_0")
    with pytest.raises(CheckpointError, match="not a complete impel checkpoint"):
        acc.load_state(tmp_path / "checkpoints" / "checkpoint_1")


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_partial_directory(tmp_path, monkeypatch):
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "checkpoint_0").iterdir()}

    def crash(session, obj, path):
        raise OSError(f"disk full while writing {path.name}")

    monkeypatch.setattr(checkpointer, "write_torch", crash)
    with pytest.raises(OSError, match="disk full"):
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "checkpoint_0").iterdir()} == before
    assert acc.save_iteration == 1  # the failed save did not consume a number


def test_leftover_temporary_directories_are_cleaned_and_ignored(tmp_path):
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    stale = tmp_path / "checkpoints" / f"{layout.TMP_PREFIX}checkpoint_1-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    _age(stale)  # an earlier impel's leftover (no lock), untouched for two hours
    assert acc.load_state().endswith("checkpoint_0")
    assert not stale.exists()


def _age(path, seconds=7200):
    old = time.time() - seconds
    os.utime(path, (old, old))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_cleans_leftovers_but_not_its_own_temporary_directory(tmp_path, asynchronous):
    """An asynchronous save names its temporary directory before its leader cleans the parent (the other ranks may
    already be filling it): the cleaning spares exactly that directory, and removes the leftovers."""
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    root = tmp_path / "checkpoints"
    stale = root / f"{layout.TMP_PREFIX}checkpoint_1-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    _age(stale)
    seen: list[list[str]] = []
    real = layout.clean_incomplete

    def spy(where, keep=None):
        assert keep is not None and keep.name.startswith(f"{layout.TMP_PREFIX}checkpoint_1-")
        keep.mkdir(parents=True, exist_ok=True)  # as another rank may have made it before the leader cleans
        removed = real(where, keep=keep)
        seen.append(sorted(p.name for p in removed))
        return removed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "clean_incomplete", spy)
        final = acc.save_state(async_save=asynchronous)
        acc.wait_for_checkpoint()
    assert seen == [[stale.name]]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert acc.load_state(final) == final


def test_total_limit_keeps_the_newest_and_numbers_continue(tmp_path):
    acc, _model, _opt = prepared(tmp_path, total_limit=2)
    names = [acc.save_state() for _ in range(4)]
    assert [n.rsplit("/", 1)[1] for n in names] == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_2", "checkpoint_3"]


def test_load_state_restores_the_iteration_so_the_next_save_gets_the_next_number(tmp_path):
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    acc.save_state()
    ProcessState._reset()
    acc2, _, _ = prepared(tmp_path)
    assert acc2.save_iteration == 0
    assert acc2.load_state().endswith("checkpoint_1")
    assert acc2.save_iteration == 2
    assert acc2.save_state().endswith("checkpoint_2")


def test_an_existing_automatic_name_is_not_overwritten(tmp_path):
    acc, _model, _opt = prepared(tmp_path)
    acc.save_state()
    acc.project_configuration.iteration = 0
    with pytest.raises(CheckpointError, match=r"checkpoint_0 already exists.*iteration = 1"):
        acc.save_state()


def test_saving_again_into_the_same_directory_replaces_it(tmp_path):
    acc, model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    with torch.no_grad():
        acc.unwrap_model(model)[0].weight.add_(1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    acc.save_state(tmp_path / "ckpt")
    with torch.no_grad():
        acc.unwrap_model(model)[0].weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_swap_interrupted_between_the_renames_is_recovered(tmp_path):
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt").rename(tmp_path / f"{layout.OLD_PREFIX}ckpt-abc")
    acc.load_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / layout.MARKER_FILE).is_file()


def test_save_refuses_a_directory_with_foreign_files(tmp_path):
    acc, _model, _opt = prepared()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not an impel checkpoint.*new or empty directory"):
        acc.save_state(tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_load_state_with_different_prepared_objects_names_the_mismatch(tmp_path):
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    ProcessState._reset()
    acc2 = Accelerator(cpu=True)
    acc2.prepare(make_mlp())
    with pytest.raises(CheckpointError, match="saved with 1 optimizers but 0 are prepared"):
        acc2.load_state(tmp_path / "ckpt")


def test_missing_paths_say_what_to_pass(tmp_path):
    acc, _model, _opt = prepared()
    with pytest.raises(ConfigError, match="save_state\\(\\) needs output_dir"):
        acc.save_state()
    with pytest.raises(ConfigError, match="load_state\\(\\) needs input_dir"):
        acc.load_state()
    with pytest.raises(CheckpointError, match="does not exist"):
        acc.load_state(tmp_path / "nope")
    ProcessState._reset()
    acc, _model, _opt = prepared(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        acc.load_state()


@pytest.mark.parametrize("kwargs,match", [
    ({"total_limit": 0}, "total_limit=0"), ({"iteration": -1}, "iteration=-1"),
    ({"automatic_checkpoint_naming": "yes"}, "automatic_checkpoint_naming='yes'"),
])
def test_project_configuration_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ProjectConfiguration(**kwargs)


def test_project_dir_twice_must_agree(tmp_path):
    with pytest.raises(ConfigError, match="contradicts project_config.project_dir"):
        Accelerator(cpu=True, project_dir=tmp_path / "a", project_config=ProjectConfiguration(tmp_path / "b"))


def test_automatic_naming_needs_a_project_dir():
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
    acc.prepare(nn.Linear(2, 1))
    with pytest.raises(ConfigError, match="needs a project directory"):
        acc.save_state()


def _reseal(ckpt, change):
    """Edit a checkpoint's manifest and seal it again, as a forger (or a buggy tool) would."""
    meta = json.loads((ckpt / layout.METADATA_FILE).read_text())
    change(meta)
    text = json.dumps(meta)
    (ckpt / layout.METADATA_FILE).write_text(text)
    (ckpt / layout.MARKER_FILE).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


@pytest.mark.parametrize("name", ["../../../victim.txt", "/ABS/victim.txt", "sub/../../victim.txt", "link/victim.txt"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_refused_and_rotation_deletes_nothing(tmp_path, name):
    project = tmp_path / "p"
    acc, _model, _opt = prepared(str(project), total_limit=1)
    acc.save_state()
    first = project / "checkpoints" / "checkpoint_0"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (first / "notes.txt").write_text("mine")
    if name.startswith("link/"):
        (first / "link").symlink_to(tmp_path, target_is_directory=True)
    name = name.replace("/ABS", str(tmp_path))
    entry = {"size": 8, "xxh3_128_blocks": ["0" * 32]}
    _reseal(first, lambda meta: meta["files"].__setitem__(name, entry))
    with pytest.raises(CheckpointError, match=r"names .*victim.txt.*a path outside its checkpoint"):
        acc.load_state(first)
    acc.save_state()  # rotation: total_limit=1 would delete checkpoint_0's files
    assert victim.read_text() == "precious" and (first / "notes.txt").read_text() == "mine"


def test_a_manifest_of_a_newer_format_is_refused_naming_the_version(tmp_path):
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    _reseal(tmp_path / "ckpt", lambda meta: meta.__setitem__("format_version", 99))
    with pytest.raises(CheckpointError, match=r"format_version 99, which this impel does not read \(it reads 1 to "
                                              r"\d\); upgrade impel"):
        acc.load_state(tmp_path / "ckpt")


_HOLD = """
import sys, time
from pathlib import Path
from impel.checkpoint.store import tempdirs
tempdirs.make(Path(sys.argv[1]))
print("holding", flush=True)
time.sleep(60)
"""


def test_cleaning_spares_another_jobs_save_in_flight_and_removes_it_once_dead(tmp_path):
    """An evaluation job loading a checkpoint while training saves the next one (or two runs saving siblings): the
    other job's temporary directory is locked by its live save, so the cleaning leaves it; once that process is
    gone (a crash), the next cleaning removes it."""
    acc, _model, _opt = prepared()
    acc.save_state(tmp_path / "ck0")
    other = tmp_path / f"{layout.TMP_PREFIX}ck1-{'a' * 24}"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(other)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "holding"
        (other / "model.safetensors").write_bytes(b"being written")
        _age(other)  # however old: a held lock means a live save
        acc.load_state(tmp_path / "ck0")  # a load cleans the parent's leftovers
        acc.save_state(tmp_path / "ck2")  # and so does a save
        assert (other / "model.safetensors").read_bytes() == b"being written"
    finally:
        holder.kill()
        holder.wait()
    acc.load_state(tmp_path / "ck0")
    assert not other.exists()


def test_a_symlink_planted_at_the_temporary_name_is_refused_and_receives_nothing(tmp_path, monkeypatch):
    from impel.checkpoint.saving import staging

    acc, _model, _opt = prepared()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(staging, "temp_token", lambda: "guessed")
    (tmp_path / f"{layout.TMP_PREFIX}ck-guessed").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"ck-guessed, the temporary directory of this save, already exists and "
                                              r"is a symlink; .*nothing was written"):
        acc.save_state(tmp_path / "ck", async_save=True)
        acc.wait_for_checkpoint()
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "ck").exists()


def test_temporary_names_do_not_tell_the_next_one():
    """On several ranks the names are keyed hashes of the save count with the job's secret: consecutive names share
    no visible counter (on one process they are random)."""
    from impel.checkpoint.saving import staging

    monkey = pytest.MonkeyPatch()
    monkey.setattr(staging, "is_distributed", lambda: True)
    monkey.setattr(staging, "_group", [None, None, "0" * 32])
    try:
        names = [staging.temp_token() for _ in range(3)]
    finally:
        monkey.undo()
    assert len(set(names)) == 3 and all(len(n) == 24 for n in names)
    assert len({n[:6] for n in names}) == 3  # not a shared prefix plus a count


def test_file_urls_are_paths(tmp_path, monkeypatch):
    """file:// URLs are local paths (other URLs: object storage, test_checkpoint_remote.py)."""
    monkeypatch.chdir(tmp_path)
    acc, _model, _opt = prepared()
    saved = acc.save_state(f"file://{tmp_path}/ck")
    assert saved == str(tmp_path / "ck") and acc.load_state(f"file://{tmp_path}/ck") == saved
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


@pytest.mark.skipif(not os.path.ismount("/dev/shm"), reason="no mount point to try (/dev/shm is not one here)")
def test_a_mount_point_as_the_target_is_refused_in_one_line():
    acc, _model, _opt = prepared()
    with pytest.raises(CheckpointError, match=r"output_dir /dev/shm is a mount point; .*pass a directory inside it"):
        acc.save_state("/dev/shm")


def test_a_temporary_directory_removed_while_a_rank_joins_it_is_a_checkpoint_error(tmp_path, monkeypatch):
    """Another rank's failed save (or a cleaner) removed the directory between this rank's mkdir and its lock: one
    CheckpointError naming it, not a raw FileNotFoundError that kills the rank."""
    from impel.checkpoint.store import tempdirs

    real_open = tempdirs.os.open

    def vanished(path, *args, **kwargs):
        if str(path).endswith(tempdirs.LOCK_NAME):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(tempdirs.os, "open", vanished)
    with pytest.raises(CheckpointError, match=r"\.impel-tmp-x, the temporary directory of this save, was removed "
                                              r"while this rank joined it"):
        tempdirs.make(tmp_path / ".impel-tmp-x")
