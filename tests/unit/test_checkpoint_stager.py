"""The staging copy of asynchronous saves: an exact, independent copy, tied tensors kept tied, and the same CPU
buffers reused by the next save of the same layout (DCP's DefaultStager allocated new ones every save)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from helpers import make_mlp
from impel import Accelerator
from impel.checkpoint.saving.stager import Stager


def test_a_staged_copy_is_exact_independent_and_keeps_ties():
    weight = torch.randn(4, 3)
    state = OrderedDict(a=weight, tied=weight, view=weight[1:], n=3, s=("x", torch.arange(5)), e=torch.empty(0))
    stager = Stager()
    staged = stager.stage(state, key=0)
    assert isinstance(staged, OrderedDict) and list(staged) == list(state)
    assert torch.equal(staged["a"], weight) and torch.equal(staged["view"], weight[1:])
    assert staged["n"] == 3 and staged["s"][0] == "x" and torch.equal(staged["s"][1], torch.arange(5))
    assert staged["tied"].untyped_storage().data_ptr() == staged["a"].untyped_storage().data_ptr()
    assert staged["view"].untyped_storage().data_ptr() == staged["a"].untyped_storage().data_ptr()
    weight.add_(1)  # training goes on: the staged copy keeps the state at the call
    assert not torch.equal(staged["a"], weight)


def test_the_next_stage_reuses_the_buffers_and_a_new_size_gets_a_new_one():
    stager = Stager()
    first = stager.stage({"w": torch.ones(1000), "b": torch.ones(10)}, key=0)
    pointers = {k: v.data_ptr() for k, v in first.items()}
    second = stager.stage({"w": torch.full((1000,), 2.0), "b": torch.ones(20)}, key=0)
    assert second["w"].data_ptr() == pointers["w"] and torch.equal(second["w"], torch.full((1000,), 2.0))
    assert second["b"].shape == (20,)
    other = stager.stage({"w": torch.ones(1000)}, key=1)  # another write of the same save: its own buffers
    assert other["w"].data_ptr() != pointers["w"]
    assert stager.held_bytes() == 4000 + 80 + 4000
    stager.close()
    assert stager.held_bytes() == 0


def test_asynchronous_saves_reuse_their_staging_buffers(tmp_path):
    acc = Accelerator(cpu=True)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    acc.backward(model(torch.randn(4, 6)).sum())
    opt.step()
    acc.save_state(tmp_path / "a", async_save=True)
    stager = acc._checkpointer._stager
    held = stager.held_bytes()
    buffers = {k: b.data_ptr() for k, b in stager._buffers.items()}
    acc.save_state(tmp_path / "b", async_save=True)
    acc.wait_for_checkpoint()
    assert stager.held_bytes() == held > 0
    assert {k: b.data_ptr() for k, b in stager._buffers.items()} == buffers


def test_plain_data_is_copied_where_training_could_change_it():
    import random

    random.seed(3)
    rng = random.getstate()  # (version, 625 ints, gauss): immutable, staged as is (deep-copying each int cost 1 ms)
    mutable = bytearray(b"abc")
    state = {"python": rng, "buffer": mutable, "counts": [1, 2], "name": "x"}
    staged = Stager().stage(state, key=0)
    assert staged["python"] == rng and staged["name"] == "x"
    mutable[0] = 0  # changed after the call: the staged copy keeps the value at the call
    state["counts"].append(3)
    assert staged["buffer"] == bytearray(b"abc") and staged["counts"] == [1, 2]
