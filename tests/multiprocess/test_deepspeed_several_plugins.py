"""Accelerate's several DeepSpeed plugins ("multiple models"), on 2 CPU ranks with DeepSpeed.

A student trained under ZeRO-2 (``deepspeed_plugins={"student": ..., "ref": ...}``, the first plugin active) and a
frozen reference model prepared under ZeRO-3 after ``AcceleratorState().select_deepspeed_plugin("ref")``, whose
outputs enter the student's loss. Checked against the same loop with one plugin and the reference model left
unprepared: the student's parameters are equal (torch.equal: the same engine, the same arithmetic), the prepared
reference model's outputs equal the unprepared model's (ZeRO-3 gathers the same fp32 weights: torch.equal), each
engine keeps its plugin's stage, ``plugin.deepspeed_config`` shows each engine's concrete JSON, ``selected`` and
``accelerator.deepspeed_plugin`` follow the selection as in Accelerate 1.15, and ``save_state`` / ``load_state``
restore the trained engine (parameters equal after training on past the save). A value the reference plugin's JSON
leaves open, written into ``ref_plugin.deepspeed_config`` before its ``prepare`` (as Accelerate's own
test_ds_multiple_model does), reaches its engine.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_optimizer, make_regression
from impel.testing import run_on_ranks

JOB_TIMEOUT = 300
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(JOB_TIMEOUT + 120)]
STEPS = 5


def _models():
    return make_mlp(seed=0), make_mlp(seed=1)


def _train(acc, model, opt, loader, ref, steps=STEPS):
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        with torch.no_grad():
            shift = ref(x)
        acc.backward(nn.functional.mse_loss(model(x), y + 0.5 * shift))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _params(acc, model):
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _single():
    from impel import Accelerator, DeepSpeedPlugin

    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0))
    student, ref = _models()
    opt = make_optimizer(student, "sgd", 0.05)
    student, opt, loader = acc.prepare(student, opt, DataLoader(make_regression(), batch_size=4))
    _train(acc, student, opt, loader, ref.eval())
    return _params(acc, student)


def _several(tmp):
    from impel import Accelerator, DeepSpeedPlugin
    from impel.state import AcceleratorState

    student_plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0)
    ref_plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}})
    acc = Accelerator(cpu=True, deepspeed_plugins={"student": student_plugin, "ref": ref_plugin})
    out = {"first_active": acc.deepspeed_plugin is student_plugin and student_plugin.selected
           and not ref_plugin.selected}
    student, ref = _models()
    plain_ref = copy.deepcopy(ref).eval()
    opt = make_optimizer(student, "sgd", 0.05)
    student, opt, loader = acc.prepare(student, opt, DataLoader(make_regression(), batch_size=4))
    out["student_json"] = (student_plugin.deepspeed_config["train_micro_batch_size_per_gpu"],
                           student_plugin.deepspeed_config["train_batch_size"])
    AcceleratorState().select_deepspeed_plugin("ref")
    out["ref_active"] = (acc.deepspeed_plugin is ref_plugin and ref_plugin.selected and not student_plugin.selected
                         and AcceleratorState().deepspeed_plugin is ref_plugin)
    # an open value written before prepare, as Accelerate's own test_ds_multiple_model does
    ref_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = student_plugin.deepspeed_config[
        "train_micro_batch_size_per_gpu"]
    ref = acc.prepare(ref)
    ref.eval()
    out["stages"] = (student.zero_optimization_stage(), ref.zero_optimization_stage(),
                     ref_plugin.deepspeed_config["zero_optimization"]["stage"])
    out["ref_micro"] = (ref.train_micro_batch_size_per_gpu(), ref_plugin.deepspeed_config["train_batch_size"])
    x = torch.randn(16, 6)
    with torch.no_grad():
        out["ref_equal"] = torch.equal(ref(x), plain_ref(x))
    _train(acc, student, opt, loader, ref)
    out["params"] = _params(acc, student)
    acc.save_state(str(tmp))
    _train(acc, student, opt, loader, ref, steps=2)
    acc.load_state(str(tmp))
    out["restored"] = _equal(_params(acc, student), out["params"])
    return out


def _job(tmp):
    several = _several(tmp)
    several["equal"] = _equal(_single(), several.pop("params"))
    return several


def test_a_trained_model_and_a_frozen_reference_model_under_two_deepspeed_plugins(tmp_path):
    for out in run_on_ranks(_job, 2, (str(tmp_path / "ckpt"),), timeout=JOB_TIMEOUT):
        assert out["first_active"] and out["ref_active"]
        assert out["student_json"] == (4, 8)  # 4 per rank x 1 step x 2 ranks, filled at prepare as Accelerate does
        assert out["stages"] == (2, 3, 3)
        assert out["ref_micro"] == (4, 8)
        assert out["ref_equal"], "the ZeRO-3 reference model's outputs differ from the unprepared model's"
        assert out["equal"], "the student trained differently from the single-plugin run"
        assert out["restored"]
