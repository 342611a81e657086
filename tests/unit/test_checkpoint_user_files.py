"""Nothing a user wrote into a checkpoint directory disappears (issue 27): a re-save keeps it, as Accelerate does;
our other writers refuse an output directory inside a checkpoint."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import make_mlp
from impel import Accelerator, CheckpointError, merge_weights
from impel.checkpoint.store import layout, ownership
from impel.testing import run_on_ranks

USER_FILES = {"notes.txt": "lr 0.1 looked best\n", "eval/results.json": '{"acc": 0.93}\n',
              "eval/deep/plot.csv": "1,2\n"}


def _prepared():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _add_user_files(directory) -> None:
    for rel, text in USER_FILES.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(text)


def _tree(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _accelerate_keeps(root: str) -> dict[str, str | None]:
    from accelerate import Accelerator as AccelerateAccelerator

    acc = AccelerateAccelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 2))
    assert model is not None
    acc.save_state(f"{root}/ck")
    for rel, text in USER_FILES.items():
        os.makedirs(os.path.dirname(f"{root}/ck/{rel}"), exist_ok=True)
        with open(f"{root}/ck/{rel}", "w") as f:
            f.write(text)
    acc.save_state(f"{root}/ck")
    return {rel: open(f"{root}/ck/{rel}").read() if os.path.exists(f"{root}/ck/{rel}") else None
            for rel in USER_FILES}


def test_accelerate_keeps_the_users_files_on_a_resave(tmp_path):
    """The reference for the behaviour below."""
    kept = run_on_ranks(_accelerate_keeps, 1, args=(str(tmp_path),), env={"ACCELERATE_USE_CPU": "1"})[0]
    assert kept == USER_FILES


def test_a_resave_keeps_every_file_the_checkpoint_does_not_own(tmp_path):
    acc, model, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    _add_user_files(ck)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    for _ in range(2):  # twice: the carried files are the user's in the new checkpoint too
        acc.save_state(ck)
        assert {rel: (ck / rel).read_text() for rel in USER_FILES} == USER_FILES
    manifest = layout.verify(ck)["files"]
    assert not set(USER_FILES) & set(manifest)  # still the user's, not the checkpoint's
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((layout.TMP_PREFIX, layout.OLD_PREFIX))]
    before = next(model.parameters()).detach().clone()
    with torch.no_grad():
        next(model.parameters()).zero_()
    acc.load_state(ck)
    assert torch.equal(next(model.parameters()), before)  # the new checkpoint's weights, not the old


def test_a_user_file_inside_a_folder_the_checkpoint_owns_is_found_alone(tmp_path):
    """A sharded checkpoint's ``model/`` folder is the checkpoint's; a file the user put in it is theirs."""
    for rel in ("model/__0_0.distcp", "model/.metadata", "model/README.md", "notes.txt", "eval/results.json",
                "impel_checkpoint.json", "COMPLETE"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    owned = {"model/__0_0.distcp", "model/.metadata", "impel_checkpoint.json", "COMPLETE"}
    assert ownership.user_entries(tmp_path, owned) == ["eval", "model/README.md", "notes.txt"]


def test_a_crash_during_the_swap_loses_no_user_file(tmp_path, monkeypatch):
    acc, _, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    _add_user_files(ck)
    before = _tree(ck)

    def crash(src, dst):
        raise OSError(5, "simulated crash at the swap")

    monkeypatch.setattr(layout.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        acc.save_state(ck)
    monkeypatch.undo()
    assert _tree(ck) == before  # untouched: the files were linked into the new copy, not moved


def test_a_user_file_where_the_new_checkpoint_writes_refuses_before_touching_anything(tmp_path):
    acc, _, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    manifest = json.loads((ck / layout.METADATA_FILE).read_text())["files"]
    owned = sorted(manifest)[0]
    meta = json.loads((ck / layout.METADATA_FILE).read_text())
    del meta["files"][owned]  # the old checkpoint does not own it: as if the user had put it there
    text = json.dumps(meta, indent=1, sort_keys=True)
    (ck / layout.METADATA_FILE).write_text(text)
    import hashlib

    (ck / layout.MARKER_FILE).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    before = _tree(ck)
    with pytest.raises(CheckpointError, match=f"holds '{owned}', which is not part of the checkpoint there but is "
                                              "a file the new checkpoint writes; move it out"):
        acc.save_state(ck)
    assert _tree(ck) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((layout.TMP_PREFIX, layout.OLD_PREFIX))]


def test_a_damaged_checkpoint_with_user_files_is_refused_before_anything_is_written(tmp_path):
    acc, _, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    _add_user_files(ck)
    (ck / layout.METADATA_FILE).write_text("{ truncated")
    before = _tree(ck)
    with pytest.raises(CheckpointError, match="is a damaged impel checkpoint, so its files cannot be told from "
                                              "yours"):
        acc.save_state(ck)
    assert _tree(ck) == before


@pytest.mark.parametrize("inside", ["", "out", "eval/export"])
def test_merge_weights_refuses_an_output_inside_a_checkpoint(tmp_path, inside):
    acc, _, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    before = _tree(ck)
    out = ck / inside if inside else ck
    with pytest.raises(CheckpointError, match=f"merge-weights output directory {out} is inside the impel "
                                              f"checkpoint {ck}; .*pass a directory outside it"):
        merge_weights(ck, out)
    assert _tree(ck) == before
    assert merge_weights(ck, tmp_path / "export")  # outside: fine


def test_save_model_and_nested_save_state_refuse_a_path_inside_a_checkpoint(tmp_path):
    acc, model, _ = _prepared()
    ck = tmp_path / "ck"
    acc.save_state(ck)
    before = _tree(ck)
    with pytest.raises(CheckpointError, match=f"save_model save_directory {ck / 'final'} is inside the impel "
                                              "checkpoint"):
        acc.save_model(model, ck / "final")
    with pytest.raises(CheckpointError, match=f"save_state output_dir {ck / 'inner'} is inside the impel "
                                              "checkpoint"):
        acc.save_state(ck / "inner")
    assert _tree(ck) == before


def test_rotation_deletes_only_what_the_checkpoint_owns(tmp_path, caplog):
    """``total_limit`` rotation: the oldest checkpoint's own files go, the user's files stay in its directory (one
    log line names them); a rotated checkpoint without user files goes as a whole."""
    from impel import ProjectConfiguration

    config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    acc = Accelerator(cpu=True, project_config=config)
    model = make_mlp()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first = acc.save_state()
    _add_user_files(tmp_path / "checkpoints" / "checkpoint_0")
    with caplog.at_level("INFO", logger="impel"):
        acc.save_state()
        acc.save_state()
    root = tmp_path / "checkpoints"
    assert _tree(root / "checkpoint_0") == {rel: text.encode() for rel, text in USER_FILES.items()}
    assert not (root / "checkpoint_1").exists()  # nothing of the user's in it: gone as a whole
    assert layout.is_complete(root / "checkpoint_2")
    kept = [r.getMessage() for r in caplog.records if "kept the directory" in r.getMessage()]
    assert kept == [f"total_limit=1: deleted the checkpoint files of {first} but kept the directory, which holds "
                    "what the checkpoint does not own: eval, notes.txt"]
    assert acc.load_state().endswith("checkpoint_2")
    assert acc.save_state().endswith("checkpoint_3")


def test_a_rotated_directory_is_skipped_quietly_but_a_half_copy_warns(tmp_path, caplog):
    """Listing checkpoints: what rotation left (the user's files only) is skipped at INFO; a directory that still
    holds impel's metadata without the marker (an interrupted copy) is skipped with a WARNING."""
    root = tmp_path / "checkpoints"
    _add_user_files(root / "checkpoint_0")
    (root / "checkpoint_1").mkdir(parents=True)
    (root / "checkpoint_1" / layout.METADATA_FILE).write_text("{}")
    with caplog.at_level("INFO", logger="impel"):
        assert layout.list_complete(root) == []
    levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records if "marker" in r.getMessage()}
    assert levels == {f"ignoring {root / 'checkpoint_0'}": "INFO", f"ignoring {root / 'checkpoint_1'}": "WARNING"}
