"""``accelerator.state`` / ``AcceleratorState()`` outlive a later short-lived Accelerator (Accelerate's shared state),
and prepared objects and the Accelerator pickle and deep-copy (Accelerate's test_pickle_accelerator /
test_can_pickle_dataloader)."""
from __future__ import annotations

import copy
import gc
import inspect
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel import Accelerator
from impel.state import AcceleratorState


def test_state_survives_a_helpers_short_lived_accelerator():
    acc = Accelerator(cpu=True, mixed_precision="bf16")

    def helper():
        return Accelerator(cpu=True, mixed_precision="bf16").num_processes

    assert helper() == 1
    gc.collect()
    assert acc.state.distributed_type == "NO"
    assert AcceleratorState().mixed_precision == "bf16"
    del acc
    gc.collect()
    with pytest.raises(RuntimeError, match="create Accelerator"):
        AcceleratorState().distributed_type  # noqa: B018 - no Accelerator left at all


def _prepared(mixed_precision):
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    loader = DataLoader(IndexDataset(6), batch_size=2)
    return acc, *acc.prepare(model, opt, loader, sched)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_prepared_objects_and_the_accelerator_pickle_and_deepcopy(mixed_precision):
    acc, model, opt, loader, sched = _prepared(mixed_precision)
    x = torch.ones(3, 2)
    expected = model(x)
    for obj in (acc, model, opt, loader, sched):
        for clone in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)):
            assert type(clone) is type(obj)
    again = pickle.loads(pickle.dumps(model))
    assert torch.equal(again(x), expected) and again(x).dtype == torch.float32  # the prepared forward, fp32 out
    assert pickle.loads(pickle.dumps(opt)).param_groups[0]["lr"] == 0.1
    assert [b.flatten().tolist() for b in pickle.loads(pickle.dumps(loader))] == [[0, 1], [2, 3], [4, 5]]
    assert pickle.loads(pickle.dumps(acc)).state.distributed_type == "NO"


def test_the_prepared_forward_shows_the_models_signature():
    _, model, *_ = _prepared("bf16")
    assert list(inspect.signature(model.forward).parameters) == ["input"]
