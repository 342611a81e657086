"""Build models without allocating their weights, and load weight files into them (Accelerate's big-model names).

Example::

    with init_empty_weights():
        model = MyModel(config)                      # parameters on the meta device: no memory used
    load_checkpoint_in_model(model, "export/")       # model.safetensors (or shards + index), loaded safely
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from impel.config import environment as env

logger = logging.getLogger("impel")


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Modules built in the block get their parameters on ``device`` (buffers too with ``include_buffers``;
    default: ``$ACCELERATE_INIT_INCLUDE_BUFFERS``, else False)."""
    device = torch.device(device)
    if include_buffers is None:
        include_buffers = env.read_flag("ACCELERATE_INIT_INCLUDE_BUFFERS")
    if include_buffers:
        with device:  # every tensor created in the block, buffers included
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        made = self._parameters[name] if param is not None else None
        if made is not None and made.device != device:  # one already there (a re-assigned, tied one) stays itself
            self._parameters[name] = _moved(made, device)

    # patched on the class for the block, as Accelerate's init_on_device does: mypy refuses any assignment to a method
    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _moved(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """``param`` on ``device``, same class, requires_grad and attributes."""
    if type(param) is nn.Parameter:
        moved = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)
        return moved
    return type(param)(param.to(device), **{**param.__dict__, "requires_grad": param.requires_grad})


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Modules built in the block have their parameters on the meta device (shapes only, no memory); load real
    weights with :func:`load_checkpoint_in_model` or ``model.to_empty(device=...)``."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


def _weight_files(checkpoint: Path) -> list[Path]:
    """The files holding a checkpoint: one file, an index's shards, or a folder's single file / single index."""
    if checkpoint.is_file():
        if checkpoint.name.endswith(".json"):
            index = json.loads(checkpoint.read_text(encoding="utf-8"))
            names = sorted(set(index.get("weight_map", {}).values()))
            if not names:
                raise ValueError(f"{checkpoint} has no weight_map; pass a Hugging Face *.index.json")
            return [checkpoint.parent / name for name in names]
        return [checkpoint]
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint={str(checkpoint)!r} does not exist; pass a weights file, an "
                                "*.index.json or a folder holding them")
    indexes = sorted(checkpoint.glob("*.index.json"))
    if len(indexes) == 1:
        return _weight_files(indexes[0])
    singles = [checkpoint / n for n in ("model.safetensors", "pytorch_model.bin") if (checkpoint / n).is_file()]
    if len(indexes) > 1 or not singles:
        found = sorted(p.name for p in checkpoint.iterdir())[:10]
        raise ValueError(f"checkpoint folder {checkpoint} must hold one *.index.json or model.safetensors / "
                         f"pytorch_model.bin; it holds {found}")
    return singles[:1]


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)  # never runs pickled code


def _matches(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") or f".{p}." in f".{name}." for p in prefixes)


def _device_for(name: str, device_map: Mapping[str, Any] | None, current: torch.Tensor) -> torch.device:
    if device_map is not None:
        best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        if best is None:
            raise ValueError(f"device_map has no entry for {name!r}; map every module (\"\" covers the whole model)")
        where = device_map[best]
        if where == "disk":
            raise ValueError(f"device_map sends {best!r} to 'disk': impel does not offload weights to disk; map it "
                             "to 'cpu' or a device index")
        return torch.device(f"cuda:{where}" if isinstance(where, int) else where)
    return torch.device("cpu") if current.device.type == "meta" else current.device


def _unsupported(**given: object) -> None:
    for name, value in given.items():
        if value:
            raise ValueError(f"load_checkpoint_in_model({name}={value!r}) is not supported: impel loads full weights "
                             "into the model on one device map without offloading or quantisation; drop it")


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | os.PathLike[str],
                             device_map: Mapping[str, Any] | None = None, offload_folder: object = None,
                             dtype: str | torch.dtype | None = None, offload_state_dict: bool = False,
                             offload_buffers: bool = False, keep_in_fp32_modules: Sequence[str] | None = None,
                             offload_8bit_bnb: bool = False, strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Load a weights file, a sharded checkpoint (``*.index.json``) or a folder holding either into ``model``, also
    when it was built under :func:`init_empty_weights`. safetensors or ``torch.load(weights_only=True)``: no
    pickled code runs. Tensors take the model's dtype (``dtype``: that one for floating tensors, except modules
    named in ``keep_in_fp32_modules``) and go to ``device_map``'s device (default: where the parameter is, CPU
    for meta). Tied parameters stay tied. ``strict``: missing or unexpected names raise instead of warning."""
    _unsupported(offload_folder=offload_folder, offload_state_dict=offload_state_dict,
                 offload_buffers=offload_buffers, offload_8bit_bnb=offload_8bit_bnb,
                 broadcast_from_rank0=broadcast_from_rank0, full_state_dict=not full_state_dict)
    target_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    slots: dict[str, tuple[nn.Module, str, bool]] = {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        slots[name] = (module, attr, attr in module._parameters)
        by_tensor.setdefault(id(tensor), []).append(name)
    tied = {name: group for group in by_tensor.values() for name in group}
    expected = set(model.state_dict())  # non-persistent buffers are not expected in a checkpoint
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in _weight_files(Path(checkpoint)):
        for name, value in _read(path).items():
            if name not in slots:
                unexpected.append(name)
                continue
            module, attr, is_param = slots[name]
            current = getattr(module, attr)
            dtype_now = current.dtype
            if value.is_floating_point():
                keep_fp32 = keep_in_fp32_modules and _matches(name, keep_in_fp32_modules)
                dtype_now = torch.float32 if keep_fp32 else (target_dtype or current.dtype)
            value = value.to(device=_device_for(name, device_map, current), dtype=dtype_now)
            new = nn.Parameter(value, requires_grad=current.requires_grad) if is_param else value
            for alias in tied[name]:  # tied names share one tensor, as before loading
                alias_module, alias_attr, _ = slots[alias]
                store: dict[str, Any] = alias_module._parameters if is_param else alias_module._buffers
                store[alias_attr] = new
                loaded.add(alias)
    _report(model, sorted(expected - loaded), unexpected, strict)


def _report(model: nn.Module, missing: list[str], unexpected: list[str], strict: bool) -> None:
    if not missing and not unexpected:
        return
    message = (f"loading weights into {type(model).__name__}: missing {missing[:10]}"
               f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
               f"{' ...' if len(unexpected) > 10 else ''}")
    if strict:
        raise RuntimeError(message + "; fix the checkpoint or pass strict=False")
    logger.warning(message)
