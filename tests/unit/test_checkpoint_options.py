"""Accelerate's extra save_state / load_state arguments: strict=False, map_location, load_kwargs; what cannot take
effect raises naming the argument."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from impel import Accelerator, ConfigError
from impel.checkpoint import CheckpointError
from impel.checkpoint.saving.options import load_options, save_options


class Head(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        if extra:
            self.adapter = nn.Parameter(torch.full((3,), 7.0))  # not in the checkpoint

    def forward(self, x):
        return self.body(x)


def _saved(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = acc.prepare(Head())
    path = acc.save_state(str(tmp_path / "ckpt"))
    return path, {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def test_strict_false_loads_the_matching_keys_and_names_the_rest(tmp_path, caplog):
    path, saved = _saved(tmp_path)
    acc = Accelerator(cpu=True)
    torch.manual_seed(1)
    model = acc.prepare(Head(extra=True))
    with pytest.raises(CheckpointError, match="adapter"):
        acc.load_state(path)  # strict by default, as torch and Accelerate
    with caplog.at_level(logging.WARNING):
        acc.load_state(path, strict=False)
    inner = acc.unwrap_model(model)
    assert torch.equal(inner.body.weight, saved["body.weight"]) and torch.equal(inner.body.bias, saved["body.bias"])
    assert torch.equal(inner.adapter, torch.full((3,), 7.0))  # untouched
    assert "strict=False" in caplog.text and "adapter" in caplog.text


@pytest.mark.parametrize("kwargs", [{"map_location": "cpu"}, {"map_location": "on_device"}, {"map_location": None},
                                    {"load_kwargs": {"map_location": "cpu", "weights_only": True}}])
def test_accelerate_map_locations_are_accepted(tmp_path, kwargs):
    path, saved = _saved(tmp_path)
    acc = Accelerator(cpu=True)
    model = acc.prepare(Head())
    acc.load_state(path, **kwargs)
    assert torch.equal(acc.unwrap_model(model).body.weight, saved["body.weight"])


@pytest.mark.parametrize("kwargs, named", [
    ({"map_location": "cuda:3"}, "cuda:3"),
    ({"load_kwargs": {"weights_only": False}}, "weights_only"),
    ({"load_kwargs": {"mmap": True}}, "mmap"),
    ({"strict": "no"}, "strict='no'"),
    ({"load_optimizer_states": False}, "load_optimizer_states"),  # DeepSpeed's, not this strategy's
])
def test_load_arguments_that_cannot_take_effect_raise(tmp_path, kwargs, named):
    path, _ = _saved(tmp_path)
    acc = Accelerator(cpu=True)
    acc.prepare(Head())
    with pytest.raises(ConfigError, match=named):
        acc.load_state(path, **kwargs)


def test_save_arguments_outside_deepspeed_raise(tmp_path):
    acc = Accelerator(cpu=True)
    acc.prepare(Head())
    with pytest.raises(ConfigError, match="exclude_frozen_parameters=True.*DeepSpeed"):
        acc.save_state(str(tmp_path / "c"), exclude_frozen_parameters=True)
    assert not (tmp_path / "c").exists()


def test_deepspeed_engine_arguments_pass_through_but_not_the_ones_impel_owns():
    assert save_options({"exclude_frozen_parameters": True}, deepspeed=True).engine_kwargs == {
        "exclude_frozen_parameters": True}
    with pytest.raises(ConfigError, match="tag"):
        save_options({"tag": "x"}, deepspeed=True)
    opts = load_options(None, {"strict": False, "load_optimizer_states": False}, deepspeed=True)
    assert not opts.strict
    assert opts.engine_kwargs == {"load_optimizer_states": False, "load_module_strict": False}
    with pytest.raises(ConfigError, match="load_lr_scheduler_states"):
        load_options(None, {"load_lr_scheduler_states": True}, deepspeed=True)
