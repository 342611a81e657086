"""Checkpoints on fsspec URLs (memory:// here; a real S3 API server in test_checkpoint_s3.py): the commit object
is written last, a prefix without it is never loaded nor counted, rotation deletes committed checkpoints only."""
from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from checkpoint_helpers import prepared_mlp
from impel import CheckpointError
from impel.checkpoint.store import layout


def prepared(project_dir=None, total_limit=None, **config):
    return prepared_mlp(project_dir, total_limit, steps=0, **config)


def train(acc, model, opt, steps=1):
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def url():
    base = f"memory://impel-test-{uuid.uuid4().hex[:8]}"
    yield base
    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)


def test_save_and_load_on_a_memory_url_writes_the_commit_object_last_and_no_local_folder(url, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    order = []
    put = type(fs).put_file
    monkeypatch.setattr(type(fs), "put_file", lambda self, lpath, rpath, **kw: (order.append(rpath.rsplit("/", 1)[-1]),
                                                                                 put(self, lpath, rpath, **kw))[1])
    acc, model, opt = prepared()
    train(acc, model, opt)
    saved = weights(model)
    assert acc.save_state(f"{url}/run") == f"{url}/run"
    assert order.index(layout.MARKER_FILE) == len(order) - 1 and layout.METADATA_FILE in order  # once, last
    assert {"model.safetensors", "optimizer.pt", "training_state.pt", "random_states_0.pt"} <= set(order)
    assert list(tmp_path.iterdir()) == []  # never a local folder named memory:
    train(acc, model, opt)
    assert acc.load_state(f"{url}/run") == f"{url}/run"
    assert all(torch.equal(a, b) for a, b in zip(weights(model), saved))


def test_a_prefix_without_its_commit_object_is_never_loaded_nor_counted(url):
    acc, model, opt = prepared(url, total_limit=2)
    fs = fsspec.filesystem("memory")
    for _ in range(3):
        train(acc, model, opt)
        acc.save_state()
    root = f"{url}/checkpoints"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["checkpoint_1", "checkpoint_2"]
    newest = weights(model)
    # an interrupted upload: checkpoint_3's files but no commit object
    fs.pipe(f"{root}/checkpoint_3/model.safetensors", b"partial")
    with pytest.raises(CheckpointError, match="no COMPLETE commit object"):
        acc.load_state(f"{root}/checkpoint_3")
    train(acc, model, opt)
    fresh, fresh_model, _ = prepared(url, total_limit=2)
    assert fresh.load_state() == f"{root}/checkpoint_2"
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh_model), newest))
    assert fresh.project_configuration.iteration == 4  # checkpoint_3's name is never reused
    train(fresh, fresh_model, opt)
    fresh.save_state()
    fresh.save_state()  # rotation keeps checkpoint_4, checkpoint_5; the partial prefix stays (not impel's commit)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    assert fs.cat(f"{root}/checkpoint_3/model.safetensors") == b"partial"


def test_async_save_to_a_memory_url_uploads_in_the_background(url):
    acc, model, opt = prepared()
    train(acc, model, opt)
    saved = weights(model)
    assert acc.save_state(f"{url}/a", async_save=True) == f"{url}/a"
    train(acc, model, opt)
    acc.load_state(f"{url}/a")
    assert all(torch.equal(a, b) for a, b in zip(weights(model), saved))


def test_a_scheme_without_its_filesystem_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acc, _model, _opt = prepared()
    with pytest.raises(CheckpointError, match=r"gs://.*pip install 'impel\[gcs\]'"):
        acc.save_state("gs://bucket/run")
    with pytest.raises(CheckpointError, match=r"nosuch://.*pip install 'impel\[fsspec\]'"):
        acc.load_state("nosuch://bucket/run")
    assert list(tmp_path.iterdir()) == []
