"""The completion marker seals one manifest, and the manifest's files must all be there to load."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from helpers import make_mlp
from impel import Accelerator, CheckpointError, ProjectConfiguration
from impel.checkpoint.store import layout


def _saved(tmp_path, saves: int = 1):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True))
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    paths = []
    for _ in range(saves):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state())
    return acc, [tmp_path / "checkpoints" / p.rsplit("/", 1)[1] for p in paths]


def test_the_marker_holds_the_sha256_of_the_metadata_it_seals(tmp_path):
    _, (ckpt,) = _saved(tmp_path)
    text = (ckpt / layout.METADATA_FILE).read_text(encoding="utf-8")
    assert (ckpt / layout.MARKER_FILE).read_text(encoding="utf-8") == hashlib.sha256(text.encode()).hexdigest() + "\n"
    assert set(json.loads(text)["files"]) == {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()
                                              and p.name not in (layout.METADATA_FILE, layout.MARKER_FILE)}


def test_an_edited_manifest_no_longer_matches_its_marker(tmp_path):
    acc, (ckpt,) = _saved(tmp_path)
    meta = json.loads((ckpt / layout.METADATA_FILE).read_text())
    meta["files"].pop("optimizer.pt")  # e.g. a hand edit that hides a file from verification
    (ckpt / layout.METADATA_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    with pytest.raises(CheckpointError, match=rf"{layout.METADATA_FILE} does not match its COMPLETE marker"):
        acc.load_state(ckpt)


def test_a_marker_copied_from_another_checkpoint_is_refused(tmp_path):
    acc, (first, second) = _saved(tmp_path, saves=2)
    shutil.copy(first / layout.MARKER_FILE, second / layout.MARKER_FILE)
    with pytest.raises(CheckpointError, match="does not match its COMPLETE marker"):
        acc.load_state(second)
    acc.load_state(first)  # the untouched one still loads


@pytest.mark.parametrize("victim", ["optimizer.pt", "model.safetensors", "random_states_0.pt"])
def test_a_file_of_the_manifest_that_is_missing_fails_the_load_naming_it(tmp_path, victim):
    acc, (ckpt,) = _saved(tmp_path)
    (ckpt / victim).unlink()
    with pytest.raises(CheckpointError) as err:
        acc.load_state(ckpt)
    message = str(err.value)
    assert f"checkpoint file {ckpt / victim} is missing" in message and "load an earlier checkpoint" in message
