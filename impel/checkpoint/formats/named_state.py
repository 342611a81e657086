"""Model and optimizer state dicts keyed by parameter name, as torch's ``get_model_state_dict`` /
``get_optimizer_state_dict`` return them with default options, without paying their per-call cost on every save.

torch's API verifies its options and walks every parameter's names (``_get_fqns``: one call per state entry) on
each call: 15-30 ms per save for a 6-layer GPT-2 on the development machine, most of what an asynchronous sharded
save spends in the call after its staging copy. The answer depends only on the structure of the model and the
optimizer, so the first call per model (per optimizer) goes through torch and records the names; later calls take
``model.state_dict()`` / ``optimizer.state_dict()``, which torch's API starts from, and apply the recorded names,
as long as the structure is the one recorded (the same keys; the same parameters in the same groups), else
torch's path again. Keys torch renames (DDP's ``module.``, a compiled module's ``_orig_mod.``) are renamed the same
way, entry by entry, when torch's answer was ``state_dict()``'s tensors in ``state_dict()``'s order; FSDP1 modules
always take torch's path. Used for the default options only (full, sharded and cooperative saves).
"""
from __future__ import annotations

import weakref
from typing import Any, cast

import torch
from torch import nn

# model -> (its state_dict() keys, torch's name for each, in the same order)
_models: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, ...], tuple[str, ...]]] = weakref.WeakKeyDictionary()
# optimizer -> (id of the model, ids of its parameters in group order, optimizer index -> name)
_optimizer_names: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, tuple[int, ...], dict[int, str]]] = \
    weakref.WeakKeyDictionary()


def model_state(model: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)``: this rank's state by name (DTensors stay DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    known = _models.get(model)
    if known is not None:
        with torch.no_grad():
            state = model.state_dict()
        if tuple(state) == known[0]:
            return dict(zip(known[1], state.values())) if known[0] != known[1] else state
    state = get_model_state_dict(model)
    with torch.no_grad():
        raw = model.state_dict()
    if len(raw) == len(state) and all(_same(a, b) for a, b in zip(raw.values(), state.values())) \
            and not _has_fsdp1(model):
        _models[model] = (tuple(raw), tuple(state))  # torch's answer is state_dict() renamed entry by entry
    return state


def _same(a: Any, b: Any) -> bool:
    """The same data (tensors: the same memory, shape and type; ``state_dict()`` detaches anew at every call)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and (a.to_local() if hasattr(a, "to_local") else a).data_ptr()
                == (b.to_local() if hasattr(b, "to_local") else b).data_ptr())
    return a is b


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)`` of an optimizer that has state (torch's API fills the state
    of one that has none: the caller handles that case)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
    known = _optimizer_names.get(optimizer)
    if known is not None and known[0] == id(model) and known[1] == params and optimizer.state:
        recorded = known[2]
        state = optimizer.state_dict()
        state["state"] = {recorded[index]: value for index, value in state["state"].items()}
        for group in state["param_groups"]:
            group["params"] = [recorded[index] for index in group["params"]]
        return state
    had_state = bool(optimizer.state)
    state = get_optimizer_state_dict(model, optimizer)
    if had_state and not _has_fsdp1(model):
        raw = optimizer.state_dict()
        names: dict[int, str] = {}
        for raw_group, group in zip(raw["param_groups"], state["param_groups"]):
            names.update(zip(raw_group["params"], cast(list[str], cast(dict[str, Any], group)["params"])))
        if len(names) == len(params) and list(state["state"]) == [names[i] for i in raw["state"]]:
            _optimizer_names[optimizer] = (id(model), params, names)
    return state


def _has_fsdp1(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
