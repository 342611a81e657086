"""Accelerator construction and prepare(): order, idempotence, and errors that name the input and the fix."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel import (
    Accelerator,
    AutocastKwargs,
    ConfigError,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from impel.runtime.loaders.data import DataLoaderShard
from impel.runtime.step.optimizer import AcceleratedOptimizer, AcceleratedScheduler


def objects():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_regression(16), batch_size=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    return {"model": model, "optimizer": opt, "dataloader": loader, "scheduler": sched}


def check_prepared(kind: str, original, prepared, prepared_optimizer=None) -> None:
    if kind == "model":
        assert prepared is original  # single device: the same module, forward patched on the instance
        assert "forward" in prepared.__dict__
    elif kind == "optimizer":
        assert isinstance(prepared, AcceleratedOptimizer) and prepared.optimizer is original
    elif kind == "dataloader":
        assert isinstance(prepared, DataLoaderShard) and prepared.original is original
    else:
        assert isinstance(prepared, AcceleratedScheduler) and prepared.scheduler is original
        assert prepared.optimizers == [prepared_optimizer]


@pytest.mark.parametrize("order", list(itertools.permutations(["model", "optimizer", "dataloader", "scheduler"])))
def test_prepare_returns_objects_in_the_order_given(order):
    acc = Accelerator(cpu=True)
    objs = objects()
    result = acc.prepare(*(objs[k] for k in order))
    assert isinstance(result, tuple) and len(result) == 4
    by_kind = dict(zip(order, result))
    for kind, prepared in by_kind.items():
        check_prepared(kind, objs[kind], prepared, by_kind["optimizer"])


def test_prepare_of_one_object_returns_it_bare():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    assert acc.prepare(model) is model
    assert isinstance(acc.prepare(DataLoader(make_regression(8), batch_size=2)), DataLoaderShard)


def test_prepared_objects_still_train():
    acc = Accelerator(cpu=True)
    objs = objects()
    model, opt, loader, sched = acc.prepare(objs["model"], objs["optimizer"], objs["dataloader"], objs["scheduler"])
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt.steps_taken == 4


def test_preparing_twice_is_harmless():
    acc = Accelerator(cpu=True)
    objs = objects()
    first = acc.prepare(objs["model"], objs["optimizer"], objs["dataloader"], objs["scheduler"])
    second = acc.prepare(*first)
    assert all(a is b for a, b in zip(first, second))
    model = first[0]
    # the original forward under the patch is the class's, not our own patched forward
    assert model.__dict__["_impel_original_forward"].__func__ is type(model).forward
    assert "_impel_user_forward" not in model.__dict__
    assert (len(acc._models), len(acc._optimizers), len(acc._dataloaders), len(acc._schedulers)) == (1, 1, 1, 1)
    x = torch.randn(3, 6)
    with torch.no_grad():
        expected = type(model).forward(model, x)
        assert torch.equal(model(x), expected)


def test_preparing_the_original_model_again_does_not_rewrap():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    acc.prepare(model)
    forward = model.__dict__["forward"]
    assert acc.prepare(model) is model
    assert model.__dict__["forward"] is forward
    assert len(acc._models) == 1


def test_preparing_twice_keeps_accumulation_correct():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(*acc.prepare(model, opt))
    x = torch.randn(4, 6)
    acc.backward(model(x).sum())
    assert not acc.sync_gradients and acc.gradient_state.micro_in_group == 1
    acc.backward(model(x).sum())
    assert acc.sync_gradients


@pytest.mark.parametrize("bad,name", [("a string", "str"), ({"a": 1}, "dict"), (3, "int"),
                                      ([make_mlp()], "list")])
def test_prepare_hands_back_other_objects_unchanged(bad, name):
    """As Accelerate's prepare: an object it does not know (a list, a tokenizer) comes back as it was given."""
    acc = Accelerator(cpu=True)
    model, same = acc.prepare(make_mlp(), bad)
    assert same is bad and type(same).__name__ == name and isinstance(model, torch.nn.Module)


def test_prepare_rejects_a_mismatched_device_placement_list():
    acc = Accelerator(cpu=True)
    with pytest.raises(ConfigError, match="2 entries for 1 objects"):
        acc.prepare(make_mlp(), device_placement=[True, False])


def test_prepare_with_device_placement_false_leaves_batches_alone():
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(make_regression(8), batch_size=2), device_placement=[False])
    assert loader.device is None


# --- constructor errors -------------------------------------------------------------------------------------------

def test_mixed_precision_names_are_case_insensitive_as_in_accelerate():
    assert Accelerator(cpu=True, mixed_precision="BF16").mixed_precision == "bf16"


@pytest.mark.parametrize("value", ["fp32", "bfloat16", "fp 16"])
def test_unknown_mixed_precision_names_the_value_and_the_choices(value):
    with pytest.raises(ConfigError) as err:
        Accelerator(cpu=True, mixed_precision=value)
    msg = str(err.value)
    assert repr(value) in msg
    for allowed in ("'no'", "'fp16'", "'bf16'"):
        assert allowed in msg


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_gradient_accumulation_steps_name_the_value(value):
    with pytest.raises(ConfigError) as err:
        Accelerator(cpu=True, gradient_accumulation_steps=value)
    msg = str(err.value)
    assert f"gradient_accumulation_steps={value!r}" in msg
    assert ">= 1" in msg


def test_accumulation_plugin_and_steps_together_are_rejected():
    with pytest.raises(ConfigError, match="not both"):
        Accelerator(cpu=True, gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))


def test_accumulation_plugin_sets_the_steps():
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3


@pytest.mark.parametrize("handler", [DistributedDataParallelKwargs(), GradScalerKwargs(), InitProcessGroupKwargs(),
                                     AutocastKwargs()])
def test_duplicate_kwargs_handlers_are_rejected(handler):
    with pytest.raises(ConfigError) as err:
        Accelerator(cpu=True, kwargs_handlers=[handler, type(handler)()])
    assert type(handler).__name__ in str(err.value)


def test_unknown_kwargs_handler_is_rejected():
    with pytest.raises(ConfigError, match="allowed types"):
        Accelerator(cpu=True, kwargs_handlers=[{"find_unused_parameters": True}])


def test_plugin_fields_are_validated():
    with pytest.raises(ConfigError, match="num_steps=0"):
        GradientAccumulationPlugin(num_steps=0)
    with pytest.raises(ConfigError, match="even_batches='yes'"):
        DataLoaderConfiguration(even_batches="yes")
    with pytest.raises(ConfigError, match="backend='nccll'"):
        InitProcessGroupKwargs(backend="nccll")
    with pytest.raises(ConfigError):
        GradScalerKwargs(backoff_factor=2.0)


def test_kwargs_handler_to_kwargs_lists_only_changes():
    assert DistributedDataParallelKwargs().to_kwargs() == {}
    assert DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs() == {"find_unused_parameters": True}


def test_single_process_defaults():
    acc = Accelerator(cpu=True)
    assert acc.distributed_type == "NO"
    assert acc.device == torch.device("cpu")
    assert (acc.num_processes, acc.process_index, acc.local_process_index) == (1, 0, 0)
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert not acc.use_distributed
    assert acc.mixed_precision == "no" and acc.scaler is None
    assert acc.gradient_accumulation_steps == 1


def test_split_batches_argument_sets_the_dataloader_config():
    acc = Accelerator(cpu=True, split_batches=True)
    assert acc.split_batches and acc.even_batches


def test_prepare_returns_none_for_none_as_accelerate():
    from impel import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    assert acc.prepare(None) is None
    prepared_model, nothing = acc.prepare(model, None)
    assert nothing is None and prepared_model is model
