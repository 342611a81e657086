"""Weights around FSDP2's sharding: which ranks hold real weights, the mixed-precision upcast, rank 0's broadcast
(sync_module_states / cpu_ram_efficient_loading) and re-pointing optimizers at the sharded parameters.

cpu_ram_efficient_loading: rank 0 builds the model with real weights, the other ranks on the meta device (no
memory). At prepare every rank shards its copy (meta shards cost nothing), the meta ranks allocate their empty
shards, and rank 0's full state dict is broadcast tensor by tensor into everyone's shards
(``set_model_state_dict(..., broadcast_from_rank0=True)``). Non-persistent buffers (not in a state dict, e.g.
rotary frequencies) are broadcast separately.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from impel.config.run_config import ConfigError

_LOW = (torch.bfloat16, torch.float16)


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def agree_on_meta(model: nn.Module, sync: bool, device: torch.device) -> bool:
    """Every rank learns which ranks hold the model on the meta device, so all raise the same error (no hang)."""
    mine = has_meta(model)
    flag = torch.tensor([int(mine)], device=device)
    flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    on_meta = [rank for rank, f in enumerate(flags) if int(f.item())]
    name = type(model).__name__
    if 0 in on_meta:
        raise ConfigError(f"{name} has tensors on the meta device on rank 0; rank 0 must hold the real weights "
                          "(with fsdp_cpu_ram_efficient_loading only the other ranks build on meta): load the model "
                          "normally on rank 0")
    if on_meta and not sync:
        raise ConfigError(f"{name} is on the meta device on ranks {on_meta} but fsdp_sync_module_states is false, so "
                          "nothing would fill it; set fsdp_cpu_ram_efficient_loading: true (it broadcasts rank 0's "
                          "weights) or build real weights on every rank")
    return mine


def upcast_low_precision(model: nn.Module) -> None:
    """bf16/fp16 parameters to fp32 in place: the Parameter objects (and so ties and optimizers) are kept."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype in _LOW:
                param.data = param.data.float()


def rank0_state(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0's full state dict, taken before sharding (references, no copy); empty elsewhere."""
    return dict(model.state_dict()) if rank == 0 else {}


def materialize(model: nn.Module, device: torch.device, shards_on_cpu: bool) -> None:
    """Give a sharded meta model real (uninitialised) storage: shards where FSDP keeps them (the CPU with
    offload), buffers on the compute device."""
    model.to_empty(device=torch.device("cpu") if shards_on_cpu else device)
    if shards_on_cpu and device.type != "cpu":
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)


def broadcast_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Fill every rank's shards, persistent and non-persistent buffers with rank 0's values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # torch types the argument as the invariant dict[str, ValueType], which a dict[str, Tensor] is not
    set_model_state_dict(model, full_state, options=options)  # type: ignore[arg-type]
    with torch.no_grad():
        for module in model.modules():
            for name in sorted(module._non_persistent_buffers_set):
                buffer = module._buffers.get(name)
                if buffer is not None:
                    dist.broadcast(buffer, src=0)


class ParamReplacements:
    """Old parameter -> the sharded one ``fully_shard`` put in its place, remembered weakly so that an optimizer
    prepared in a later ``prepare`` call than its model is re-pointed too, without keeping full tensors alive."""

    def __init__(self) -> None:
        self._new: Any = WeakIdKeyDictionary()

    @staticmethod
    def owners(model: nn.Module) -> list[tuple[nn.Parameter, nn.Module, str]]:
        return [(p, m, name) for m in model.modules() for name, p in m._parameters.items() if p is not None]

    def record(self, owners: list[tuple[nn.Parameter, nn.Module, str]]) -> None:
        for old, module, name in owners:
            new = module._parameters.get(name)
            if new is not None and new is not old:
                self._new[old] = new

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild the optimizer's param_groups on the sharded parameters, hyper-parameters kept."""
        stale = [p for g in optimizer.param_groups for p in g["params"] if p in self._new]
        if not stale:
            return
        if any(p in optimizer.state for p in stale):
            raise ConfigError(f"{type(optimizer).__name__} already has state for parameters that FSDP replaced by "
                              "their shards; prepare the optimizer before its first step (or create it after "
                              "accelerator.prepare(model))")
        for group in optimizer.param_groups:
            group["params"] = [self._new.get(p, p) for p in group["params"]]
