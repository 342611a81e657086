"""State dicts by name from recorded names (checkpoint/formats/named_state.py) equal torch's get_model_state_dict /
get_optimizer_state_dict, save after save, and fall back to torch's API whenever the structure changed."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from impel.checkpoint.formats import named_state


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_recorded_names_give_torchs_answer_save_after_save():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    model.register_buffer("scale", torch.ones(2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}])
    _step(model, opt)
    for _ in range(3):  # the first call records; the later ones use the record
        assert _same(named_state.model_state(model), get_model_state_dict(model))
        assert _same(named_state.optimizer_state(model, opt), get_optimizer_state_dict(model, opt))
        _step(model, opt)
    assert model in named_state._models and opt in named_state._optimizer_names


def test_a_changed_structure_takes_torchs_path_again():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    named_state.optimizer_state(model, opt)
    opt.add_param_group({"params": model[1].parameters(), "lr": 0.01})  # new parameters: the record no longer fits
    _step(model, opt)
    assert _same(named_state.optimizer_state(model, opt), get_optimizer_state_dict(model, opt))
    assert len(named_state._optimizer_names[opt][2]) == 4
    named_state.model_state(model)
    model.register_buffer("extra", torch.zeros(1))  # a new key: the record no longer fits
    assert _same(named_state.model_state(model), get_model_state_dict(model))
    assert "extra" in named_state._models[model][1]


def test_keys_torch_renames_are_renamed_the_same_way():
    """torch's API strips the ``_orig_mod.`` of a compiled module's keys (DDP's ``module.`` alike): recorded once,
    later saves rename ``state_dict()``'s keys the same way, and give torch's answer after the weights changed."""
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = named_state.model_state(model)
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert named_state._models[model] == (tuple(f"_orig_mod.{k}" for k in state), tuple(state))
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        assert _same(named_state.model_state(model), get_model_state_dict(model))


def test_torchs_answer_other_than_a_renaming_is_never_recorded(monkeypatch):
    """When torch's answer is not ``state_dict()``'s tensors entry by entry (here: a copy), nothing is recorded and
    every call takes torch's path."""
    import torch.distributed.checkpoint.state_dict as api

    model = nn.Linear(3, 2)
    real = api.get_model_state_dict
    monkeypatch.setattr(api, "get_model_state_dict", lambda m: {k: v.clone() for k, v in real(m).items()})
    assert list(named_state.model_state(model)) == ["weight", "bias"]
    assert model not in named_state._models
