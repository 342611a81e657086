"""Model and optimizer state from Accelerate's ``save_state`` layouts (see :mod:`impel.accelerator.load_accelerate`).

Full files (plain and FSDP FULL_STATE_DICT) hold full tensors; they go through ``set_model_state_dict`` /
``set_optimizer_state_dict`` with ``full_state_dict=True``, so they load into one-process, DDP and FSDP2 models
alike (sharded on the way in). Accelerate's plain optimizer files are ``optimizer.state_dict()``, keyed by parameter
position; they are re-keyed by parameter name first. DCP directories (FSDP SHARDED_STATE_DICT) hold ``{"model":
...}`` / ``{"optimizer": ...}`` as impel's own sharded checkpoints do, and DeepSpeed engine checkpoints are
DeepSpeed's: both go to the strategy's own loader.
"""
from __future__ import annotations

import re
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from impel.checkpoint.formats.full import first_mismatch, pair_optimizers, read_weights
from impel.checkpoint.io.files import read_torch
from impel.checkpoint.saving.options import DEFAULT_LOAD, LoadOptions
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from impel.accelerator.prepared import TrainingRun


def load_models_and_optimizers(run: TrainingRun, directory: Path, plan: dict[str, Any],
                               skip: AbstractSet[int], options: LoadOptions = DEFAULT_LOAD) -> None:
    """Every rank: the weights and optimizer states ``plan`` lists into the prepared models and optimizers."""
    models, optimizers = list(run.prepared.models), run.prepared.inner_optimizers()
    kind = plan["weights"]
    deepspeed = run.strategy.engine_managed
    if kind == "deepspeed" and not deepspeed:
        raise CheckpointError(f"{directory / plan['models'][0]} is a DeepSpeed engine checkpoint; resume under "
                              "DeepSpeed, or convert it to full weights with DeepSpeed's zero_to_fp32.py (saved in "
                              f"{directory}) and load them into the model before prepare()")
    if deepspeed and kind != "deepspeed":
        raise CheckpointError(f"{directory} holds {kind.replace('_', ' ')} weights ({plan['models'][:1]}) but this run "
                              "uses DeepSpeed, whose engines resume only from DeepSpeed engine checkpoints; resume "
                              "with the strategy the Accelerate run used, or load the weights into the model before "
                              "prepare()")
    if kind == "deepspeed":
        for i, tag in enumerate(plan["models"]):
            run.strategy.load_checkpoint(None, [models[i]], [], directory, _deepspeed_metadata(directory, tag),
                                         skip_models=frozenset({0}) if i in skip else frozenset(), options=options)
        return
    if kind == "sharded":  # DCP directories holding {"model": ...} / {"optimizer": ...}, as impel's own
        metadata = {"format": "sharded", "models": plan["models"], "optimizers": plan["optimizers"]}
        run.strategy.load_checkpoint(None, models, optimizers, directory, metadata, skip_models=skip,
                                     options=options)  # Accelerate's files: no manifest
        return
    _load_full(models, optimizers, directory, plan, skip, strict=options.strict)


def _deepspeed_metadata(directory: Path, tag: str) -> dict[str, Any]:
    ranks = {m.group(1) for f in (directory / tag).iterdir() if (m := re.search(r"zero_pp_rank_(\d+)_", f.name))}
    return {"format": "deepspeed", "models": [""], "tag": tag, "world_size": len(ranks) or None}


def _load_full(models: list[nn.Module], optimizers: list[torch.optim.Optimizer], directory: Path,
               plan: dict[str, Any], skip: AbstractSet[int], strict: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from impel.checkpoint.formats.full import _load_fresh_optimizer

    # full tensors in the files: they load into plain, DDP and FSDP2 (sharded on the way in) models alike
    options = StateDictOptions(full_state_dict=True, strict=strict)
    loaded = [i for i in range(len(models)) if i not in skip]
    if plan["weights"] == "fsdp_full":  # FSDP files are numbered by model index, plain ones over the loaded models
        pairs = [(i, plan["models"][i]) for i in loaded]
    else:
        pairs = list(zip(loaded, plan["models"]))
    for i, name in pairs:
        state = match_names(read_weights(None, directory / name), models[i])  # Accelerate's: no manifest
        try:
            # torch types the argument as the invariant dict[str, ValueType], which a dict[str, Tensor] is not
            set_model_state_dict(models[i], state, options=options)  # type: ignore[arg-type]
        except (RuntimeError, KeyError, ValueError) as exc:
            why = first_mismatch(models[i], state) or str(exc)
            raise CheckpointError(f"{directory / name} does not fit prepared model {i} ({type(models[i]).__name__}): "
                                  f"{why}; prepare the model the Accelerate run saved") from None
    for i, (opt, owner) in enumerate(zip(optimizers, pair_optimizers(models, optimizers))):
        path = directory / plan["optimizers"][i]
        opt_state = by_name(models[owner], opt, read_torch(None, path, f"optimizer {i}"), path)
        if not opt_state["state"]:
            _load_fresh_optimizer(opt, opt_state)
        else:
            set_optimizer_state_dict(models[owner], opt, opt_state, options=options)


def match_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Drop wrapper prefixes the file has and the model's names lack; give tied names the tensor stored once."""
    inner = getattr(model, "module", model)
    own = inner.state_dict(keep_vars=True)
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state) and not all(k.startswith(prefix) for k in own):
            state = {k[len(prefix):]: v for k, v in state.items()}
    tied: dict[int, list[str]] = {}
    for name, tensor in own.items():
        tied.setdefault(id(tensor), []).append(name)
    for names in tied.values():  # Accelerate's safetensors writer keeps one name of tied weights
        present = [n for n in names if n in state]
        for name in names if present else ():
            state.setdefault(name, state[present[0]])
    return state


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """An optimizer state dict keyed by position (``optimizer.state_dict()``) re-keyed by parameter name, as
    ``set_optimizer_state_dict`` reads it; a name-keyed one (Accelerate's FSDP files) is returned as it is."""
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{path} is not an optimizer state_dict (no 'state' and 'param_groups')")
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    saved = [len(g["params"]) for g in groups]
    live = [len(g["params"]) for g in optimizer.param_groups]
    if saved != live:
        raise CheckpointError(f"{path} holds an optimizer whose parameter groups have {saved} parameters, but the "
                              f"prepared {type(optimizer).__name__} has {live}; build the optimizer as the Accelerate "
                              "run did")
    names = param_names(model)
    index: dict[object, str] = {}  # the saved position -> the parameter's name
    renamed = []
    for group, mine in zip(groups, optimizer.param_groups):
        fqns = [names[id(p)] for p in mine["params"]]
        index.update(zip(group["params"], fqns))
        renamed.append(dict(group, params=fqns))
    return {"state": {index[k]: v for k, v in state["state"].items()}, "param_groups": renamed}


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name as ``torch.distributed.checkpoint.state_dict`` spells it (no DDP ``module.``)."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    # the function get/set_optimizer_state_dict name parameters with (private, present since torch 2.2)
    _get_fqns = getattr(dcp_state_dict, "_get_fqns", None)
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        if _get_fqns is not None:
            name = sorted(_get_fqns(model, name))[0]
        else:
            name = re.sub(r"^(module\.|_orig_mod\.)+", "", name)
        names.setdefault(id(param), name)
    return names
