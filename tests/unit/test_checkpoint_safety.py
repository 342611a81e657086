"""Nothing in a checkpoint can run code: malicious pickles fail to load and execute nothing."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from helpers import make_mlp
from impel import Accelerator, CheckpointError, merge_weights
from impel.checkpoint.formats import sharded
from impel.checkpoint.saving.session import SaveSession
from impel.checkpoint.store import layout


class Payload:
    """Unpickling this object would run a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def reseal(directory: Path) -> None:
    """Rewrite the manifest and marker as an attacker who controls the whole directory would."""
    meta = json.loads((directory / layout.METADATA_FILE).read_text())
    meta["files"] = layout.build_manifest(directory)
    text = json.dumps(meta, indent=1, sort_keys=True)
    (directory / layout.METADATA_FILE).write_text(text)
    (directory / layout.MARKER_FILE).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def saved(tmp_path, safe_serialization=True):
    acc = Accelerator(cpu=True)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.save_state(tmp_path / "ckpt", safe_serialization=safe_serialization)
    return acc, tmp_path / "ckpt"


def test_the_payload_really_runs_under_plain_pickle(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))  # the control: the exploit is real
    assert marker.exists()


@pytest.mark.parametrize("victim,safe", [("training_state.pt", True), ("optimizer.pt", True),
                                         ("random_states_0.pt", True), ("pytorch_model.bin", False)])
def test_a_malicious_pickle_fails_to_load_and_executes_nothing(tmp_path, victim, safe):
    acc, ckpt = saved(tmp_path, safe_serialization=safe)
    marker = tmp_path / "pwned"
    torch.save({"state": Payload(marker)}, ckpt / victim)
    reseal(ckpt)
    with pytest.raises(CheckpointError, match=rf"refusing to load .*{victim}.*posix.system.*never runs pickled code"):
        acc.load_state(ckpt)
    assert not marker.exists()


def test_a_malicious_dcp_metadata_fails_to_load_and_executes_nothing(tmp_path):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = sharded.save_sharded(SaveSession(tmp_path), [model], [opt])  # outside save_state: written at once
    marker = tmp_path / "pwned"
    (tmp_path / "model" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="refusing to load DCP metadata.*system"):
        sharded.load_sharded(None, [make_mlp()], [torch.optim.SGD(make_mlp().parameters(), lr=0.1)], tmp_path, meta)
    with pytest.raises(CheckpointError, match="refusing to load DCP metadata"):
        sharded.load_full_state(None, tmp_path / "model")
    assert not marker.exists()


def test_merge_weights_refuses_a_malicious_file_too(tmp_path):
    _acc, ckpt = saved(tmp_path, safe_serialization=False)
    marker = tmp_path / "pwned"
    torch.save({"w": Payload(marker)}, ckpt / "pytorch_model.bin")
    reseal(ckpt)
    with pytest.raises(CheckpointError, match="refusing to load"):
        merge_weights(ckpt, tmp_path / "out")
    assert not marker.exists()
