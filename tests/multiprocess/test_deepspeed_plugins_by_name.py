"""Accelerate's named DeepSpeed plugins: ``Accelerator(deepspeed_plugins={name: plugin})`` with one plugin trains
exactly as ``deepspeed_plugin=plugin`` (same parameters, ``torch.equal``, ZeRO-2 on 2 CPU ranks), and the state's
``deepspeed_plugins`` / ``get_deepspeed_plugin`` / ``select_deepspeed_plugin`` answer as Accelerate 1.15's do for
it (the dict, the plugin, a no-op for its own name, a KeyError for another). Several plugins raise NotProvidedError
naming the reason and the alternative (tests/unit/test_accelerate_not_provided_members.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_optimizer, make_regression
from impel.testing import run_on_ranks

JOB_TIMEOUT = 300
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(JOB_TIMEOUT + 120)]


def _train(**plugin_argument):
    from impel import Accelerator

    acc = Accelerator(cpu=True, **plugin_argument)
    torch.manual_seed(0)
    model = make_mlp()
    opt = make_optimizer(model, "sgd", 0.05)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(), batch_size=4))
    for step, (x, y) in enumerate(loader):
        if step == 5:
            break
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return acc, {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _job():
    from impel import DeepSpeedPlugin
    from impel.state import AcceleratorState

    _, plain = _train(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    plugin = DeepSpeedPlugin(zero_stage=2)
    acc, named = _train(deepspeed_plugins={"student": plugin})
    state = AcceleratorState()
    answers = {"dict": state.deepspeed_plugins == {"student": plugin}, "get": state.get_deepspeed_plugin("student")
               is plugin, "active": acc.deepspeed_plugin is plugin and acc.state.deepspeed_plugin is plugin}
    state.select_deepspeed_plugin("student")
    try:
        state.select_deepspeed_plugin("teacher")
    except KeyError as error:
        answers["unknown"] = str(error)
    answers["equal"] = plain.keys() == named.keys() and all(torch.equal(plain[k], named[k]) for k in plain)
    return answers


def test_one_named_deepspeed_plugin_trains_as_the_plugin_and_answers_as_accelerate():
    for answers in run_on_ranks(_job, 2, timeout=JOB_TIMEOUT):
        assert answers["equal"] and answers["dict"] and answers["get"] and answers["active"]
        assert "'teacher'" in answers["unknown"] and "'student'" in answers["unknown"]
