"""transformers' FSDP checkpoint calls, served by impel for impel's FSDP2 plugin.

transformers' Trainer saves and loads an FSDP model and optimizer with the functions it imports from Accelerate
(``save_fsdp_model``, ``save_fsdp_optimizer``, ``load_fsdp_model``, ``load_fsdp_optimizer``), which read Accelerate's
plugin internals. Importing :mod:`impel.trainer.hf` resolves those names in ``transformers.trainer`` to the
dispatchers here: impel's plugin goes to torch's ``torch.distributed.checkpoint.state_dict`` API in Accelerate's file
layout (``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` / ``optimizer.bin`` written by rank 0;
``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/`` / ``optimizer_0/`` with DCP), anything else to Accelerate's own.

Example::

    save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, "out/checkpoint-3")
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed.checkpoint as dcp
import transformers.trainer
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from impel.config.plugins import FullyShardedDataParallelPlugin
from impel.config.run_config import ConfigError

MODEL_NAME = "pytorch_model_fsdp"
_State = TypeVar("_State")


class _Ranks(Protocol):
    """What is read of the Accelerator (impel's or Accelerate's)."""

    @property
    def num_processes(self) -> int: ...
    @property
    def process_index(self) -> int: ...

OPTIMIZER_NAME = "optimizer"
_ACCELERATE = {name: getattr(transformers.trainer, name)
               for name in ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer")}


def _full(plugin: Any) -> bool:  # state_dict_type is a generated field, unseen by mypy
    kind = str(plugin.state_dict_type)
    if "FULL_STATE_DICT" in kind:
        return True
    if "SHARDED_STATE_DICT" in kind:
        return False
    raise ConfigError(f"fsdp_config state_dict_type={kind!r}: transformers' Trainer on impel saves FULL_STATE_DICT "
                      "or SHARDED_STATE_DICT")


def _options(plugin: FullyShardedDataParallelPlugin, accelerator: _Ranks) -> StateDictOptions:
    full = _full(plugin)
    return StateDictOptions(full_state_dict=full, cpu_offload=full and accelerator.num_processes > 1)


def _path(directory: str, name: str, index: int, full: bool) -> str:
    if full:
        return os.path.join(directory, f"{name}.bin" if index == 0 else f"{name}_{index}.bin")
    return os.path.join(directory, f"{name}_{index}")


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # impel's AcceleratedOptimizer wraps torch's


def _adapters(model: torch.nn.Module, adapter_only: bool) -> bool:
    """transformers passes ``adapter_only=True`` always; it means "the adapters alone" for a PEFT model only."""
    return adapter_only and getattr(model, "peft_config", None) is not None


def _model_options(plugin: FullyShardedDataParallelPlugin, accelerator: _Ranks, adapters: bool) -> StateDictOptions:
    """A PEFT model's adapter-only checkpoint holds its trainable parameters only, as Accelerate's FSDP2 one (the
    frozen base is left out on save and left as it is on load)."""
    options = _options(plugin, accelerator)
    return dataclasses.replace(options, ignore_frozen_params=True, strict=False) if adapters else options


def _save(accelerator: _Ranks, state: Mapping[str, object], path: str, key: str, full: bool) -> None:
    if full:
        if accelerator.process_index == 0:
            torch.save(state, path)
    else:
        dcp.save({key: state}, checkpoint_id=path)


def _load(state: _State, path: str, key: str, full: bool) -> _State:
    if full:
        loaded: _State = torch.load(path, map_location="cpu", weights_only=False)
        return loaded
    wrapped = {key: state}
    dcp.load(wrapped, checkpoint_id=path)
    return wrapped[key]


def save_fsdp_model(plugin: object, accelerator: _Ranks, model: torch.nn.Module, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, **kwargs: object) -> None:
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        return _ACCELERATE["save_fsdp_model"](plugin, accelerator, model, output_dir, model_index, adapter_only,
                                              **kwargs)
    os.makedirs(output_dir, exist_ok=True)
    full = _full(plugin)
    state = get_model_state_dict(model, options=_model_options(plugin, accelerator, _adapters(model, adapter_only)))
    _save(accelerator, state, _path(output_dir, MODEL_NAME, model_index, full), "model", full)


def load_fsdp_model(plugin: object, accelerator: _Ranks, model: torch.nn.Module, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, **kwargs: object) -> object:
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        return _ACCELERATE["load_fsdp_model"](plugin, accelerator, model, input_dir, model_index, adapter_only,
                                              **kwargs)
    full = _full(plugin)
    options = _model_options(plugin, accelerator, _adapters(model, adapter_only))
    state = _load(get_model_state_dict(model, options=options), _path(input_dir, MODEL_NAME, model_index, full),
                  "model", full)
    return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=full, strict=options.strict))


def save_fsdp_optimizer(plugin: object, accelerator: _Ranks, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                        output_dir: str, optimizer_index: int = 0, **kwargs: object) -> None:
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        return _ACCELERATE["save_fsdp_optimizer"](plugin, accelerator, optimizer, model, output_dir,
                                                  optimizer_index, **kwargs)
    os.makedirs(output_dir, exist_ok=True)
    full = _full(plugin)
    state = get_optimizer_state_dict(model, _inner(optimizer), options=_options(plugin, accelerator))
    _save(accelerator, state, _path(output_dir, OPTIMIZER_NAME, optimizer_index, full), "optimizer", full)
    return None


def load_fsdp_optimizer(plugin: object, accelerator: _Ranks, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                        input_dir: str, optimizer_index: int = 0, adapter_only: bool = False,
                        **kwargs: object) -> None:
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        return _ACCELERATE["load_fsdp_optimizer"](plugin, accelerator, optimizer, model, input_dir,
                                                  optimizer_index, adapter_only, **kwargs)
    full = _full(plugin)
    options = _options(plugin, accelerator)
    inner = _inner(optimizer)
    state = _load(get_optimizer_state_dict(model, inner, options=options),
                  _path(input_dir, OPTIMIZER_NAME, optimizer_index, full), "optimizer", full)
    set_optimizer_state_dict(model, inner, state, options=StateDictOptions(full_state_dict=full))
    return None


def install() -> None:
    """Point transformers' module-level names at the dispatchers above (idempotent)."""
    for name, function in (("save_fsdp_model", save_fsdp_model), ("save_fsdp_optimizer", save_fsdp_optimizer),
                           ("load_fsdp_model", load_fsdp_model), ("load_fsdp_optimizer", load_fsdp_optimizer)):
        setattr(transformers.trainer, name, function)
