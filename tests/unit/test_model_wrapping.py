"""The prepared model's patched forward: unwrap_model, deepcopy, user-patched forwards."""
from __future__ import annotations

import copy
import types

import torch
from torch import nn

from helpers import make_mlp
from impel import Accelerator


def test_unwrap_model_without_fp32_wrapper_restores_the_original_forward():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = nn.Linear(4, 3)
    prepared = acc.prepare(model)
    x = torch.randn(2, 4)
    exact = x @ model.weight.T + model.bias
    out = prepared(x)  # computed in bf16, returned in fp32 (as Accelerate)
    assert out.dtype == torch.float32 and not torch.equal(out, exact)
    kept = acc.unwrap_model(prepared)  # keep_fp32_wrapper=True by default: still prepared
    assert kept is model and "forward" in model.__dict__
    assert torch.equal(kept(x), out)
    plain = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert plain is model
    for name in ("forward", "_impel_original_forward", "_impel_ctx"):
        assert name not in plain.__dict__
    assert plain.forward.__func__ is nn.Linear.forward
    out = plain(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, exact)


def test_unwrap_model_restores_a_forward_the_user_patched():
    acc = Accelerator(cpu=True)
    model = nn.Linear(4, 3)

    def doubled(self, x):
        return 2 * nn.Linear.forward(self, x)

    model.forward = types.MethodType(doubled, model)
    user_forward = model.forward
    prepared = acc.prepare(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(prepared(x), 2 * nn.Linear.forward(model, x))  # the user's patch still runs
    plain = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert plain.__dict__["forward"] is user_forward
    torch.testing.assert_close(plain(x), 2 * nn.Linear.forward(model, x))


def test_deepcopy_of_a_prepared_model_runs_the_copys_weights():
    acc = Accelerator(cpu=True)
    model = acc.prepare(make_mlp())
    clone = copy.deepcopy(model)
    assert clone is not model
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1.0)
    x = torch.randn(5, 6)
    with torch.no_grad():
        original_out = model(x)
        clone_out = clone(x)
        expected_clone = type(clone).forward(clone, x)  # the class's forward with the copy's weights
        expected_original = type(model).forward(model, x)
    torch.testing.assert_close(clone_out, expected_clone)
    torch.testing.assert_close(original_out, expected_original)
    assert not torch.allclose(clone_out, original_out)
    assert clone.__dict__["_impel_original_forward"].__self__ is clone


def test_deepcopy_of_a_prepared_model_keeps_autocast_and_shares_the_context():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(nn.Linear(4, 2))
    clone = copy.deepcopy(model)
    assert clone.__dict__["_impel_ctx"] is model.__dict__["_impel_ctx"]
    x = torch.randn(3, 4)
    out = clone(x)  # autocast inside (bf16 rounding), fp32 outside (as Accelerate)
    assert out.dtype == torch.float32
    assert torch.equal(out, nn.functional.linear(x.bfloat16(), clone.weight.bfloat16(), clone.bias.bfloat16()).float())


def test_deepcopy_of_a_prepared_model_can_train_alone():
    acc = Accelerator(cpu=True)
    model = acc.prepare(make_mlp())
    clone = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    clone(torch.randn(3, 6)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in clone.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_prepared_model_class_is_untouched():
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(2, 2))
    assert type(model) is nn.Linear
    other = nn.Linear(2, 2)
    assert "forward" not in other.__dict__


def test_get_state_dict_is_the_plain_state_dict():
    acc = Accelerator(cpu=True)
    model = acc.prepare(make_mlp())
    state = acc.get_state_dict(model)
    assert list(state) == list(make_mlp().state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v)
