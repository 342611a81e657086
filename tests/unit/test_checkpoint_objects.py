"""Registered objects, state hooks, save_model in Hugging Face's layout, merge_weights and the DCP format."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from helpers import make_mlp
from impel import Accelerator, CheckpointError, merge_weights
from impel.checkpoint.formats import hf, sharded
from impel.runtime.ranks.process import ProcessState


class Counter:
    def __init__(self) -> None:
        self.count = 0
        self.history: list[float] = []

    def state_dict(self):
        return {"count": self.count, "history": list(self.history), "t": torch.arange(3)}

    def load_state_dict(self, state):
        self.count = state["count"]
        self.history = list(state["history"])


def prepared(**kwargs):
    acc = Accelerator(cpu=True, **kwargs)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (acc, *acc.prepare(model, opt))


def test_registered_objects_round_trip(tmp_path):
    acc, _model, _opt = prepared()
    counter = Counter()
    counter.count, counter.history = 7, [0.5, 0.25]
    acc.register_for_checkpointing(counter)
    acc.save_state(tmp_path / "ckpt")
    counter.count, counter.history = 0, []
    acc.load_state(tmp_path / "ckpt")
    assert (counter.count, counter.history) == (7, [0.5, 0.25])


def test_registering_an_object_without_state_dict_names_it():
    acc, _model, _opt = prepared()
    with pytest.raises(ValueError, match=r"Item at index 0, torch\.Tensor"):  # Accelerate's exception type
        acc.register_for_checkpointing(torch.ones(2))
    with pytest.raises(ValueError, match=r"Item at index 1, builtins\.object, has no state_dict\(\) or "
                                        r"load_state_dict\(\)"):
        acc.register_for_checkpointing(Counter(), object())
    with pytest.raises(ValueError, match=r"Item at index 0, torch\.Tensor.*; Item at index 1, torch\.Tensor") as raised:
        acc.register_for_checkpointing(torch.ones(1), torch.ones(2), Counter())  # every bad item, as Accelerate's
    assert "index 2" not in str(raised.value)


class Opaque:
    pass


class Holder(Counter):
    def state_dict(self):
        return {"thing": Opaque()}


def test_a_registered_object_with_custom_types_fails_at_save_with_the_fix(tmp_path):
    acc, _model, _opt = prepared()
    acc.register_for_checkpointing(Holder())
    with pytest.raises(CheckpointError, match=r"registered object 0, .*Holder.*Opaque.*make its state_dict\(\) "
                                              "return"):
        acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_save_hook_sees_the_temporary_directory_and_its_files_are_committed(tmp_path):
    acc, model, _opt = prepared()
    seen = []

    def hook(models, weights, output_dir):
        seen.append((len(models), sorted(weights[0]), output_dir))
        with open(f"{output_dir}/extra.json", "w") as f:
            json.dump({"note": 1}, f)

    handle = acc.register_save_state_pre_hook(hook)
    acc.save_state(tmp_path / "ckpt")
    assert seen[0][0] == 1 and seen[0][1] == sorted(model.state_dict())
    assert ".impel-tmp-ckpt" in seen[0][2]
    meta = json.loads((tmp_path / "ckpt" / "impel_checkpoint.json").read_text())
    assert "extra.json" in meta["files"]
    handle.remove()
    acc.save_state(tmp_path / "ckpt2")
    assert len(seen) == 1


def test_hooks_that_take_a_model_over_stop_impel_saving_and_loading_it(tmp_path):
    acc, model, _opt = prepared()

    def save_hook(models, weights, output_dir):
        torch.save(weights.pop(0), f"{output_dir}/my_model.pt")

    def load_hook(models, input_dir):
        models.pop(0).load_state_dict(torch.load(f"{input_dir}/my_model.pt", weights_only=True))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_save_model_single_file_stores_tied_weights_once(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(Tied())
    acc.save_model(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    full = model.state_dict()
    assert set(saved) == set(full) - {"head.weight"}
    assert all(torch.equal(saved[k], full[k]) for k in saved)


def test_save_model_shards_with_an_index(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)))
    acc.save_model(model, tmp_path / "out", max_shard_size="17KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    merged = {}
    for name in files:
        merged.update(load_file(tmp_path / "out" / name))
    full = model.state_dict()
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in full.values())
    acc.save_model(model, tmp_path / "out")  # now one file: the stale shards and index go
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_save_model_without_safetensors_writes_pytorch_model_bin(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(make_mlp())
    acc.save_model(model, tmp_path / "out", safe_serialization=False)
    loaded = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("size,expected", [("10GB", 10 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                           (1234, 1234), ("1.5kb", 1500)])
def test_parse_size(size, expected):
    assert hf.parse_size(size) == expected


@pytest.mark.parametrize("size", ["ten", "0GB", -3, "5XB"])
def test_parse_size_rejects_nonsense(size):
    with pytest.raises(ValueError, match="max_shard_size=.* is not a size"):
        hf.parse_size(size)


def test_merge_weights_of_a_full_checkpoint_equals_the_state_dict(tmp_path):
    acc, model, _opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    files = merge_weights(tmp_path / "ckpt", tmp_path / "out")
    assert [f.name for f in files] == ["model.safetensors"]
    merged = load_file(files[0])
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match="model_index=1 is out of range.*holds 1 model"):
        merge_weights(tmp_path / "ckpt", tmp_path / "out", model_index=1)


def _use_dcp(acc):
    """Stand-in for FSDP's SHARDED_STATE_DICT: the strategy writes DCP through impel.checkpoint.formats.sharded."""
    acc.strategy.save_checkpoint = lambda session, models, opts, **kw: sharded.save_sharded(
        session, models, opts, skip_models=kw["skip_models"])
    acc.strategy.load_checkpoint = lambda manifest, models, opts, directory, meta, **kw: sharded.load_sharded(
        manifest, models, opts, directory, meta, skip_models=kw["skip_models"])


def test_a_strategy_writing_dcp_plugs_in_for_save_load_and_merge(tmp_path):
    acc, model, opt = prepared()
    _use_dcp(acc)
    x = torch.randn(8, 6)
    model(x).sum().backward()
    opt.step()
    acc.save_state(tmp_path / "ckpt")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    merged = load_file(merge_weights(tmp_path / "ckpt", tmp_path / "out")[0])
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)
    ProcessState._reset()
    acc2, model2, opt2 = prepared()
    _use_dcp(acc2)
    acc2.load_state(tmp_path / "ckpt")
    assert all(torch.equal(v, expected[k]) for k, v in model2.state_dict().items())
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
