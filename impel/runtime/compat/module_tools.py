"""Accelerate's model-inspection helpers (``accelerate.utils.modeling`` / ``.other`` / ``.fsdp_utils``) that
training code uses: tensor storage identity, tied parameters, module sizes, size strings.

Example::

    find_tied_parameters(model)      # [["lm_head.weight", "embed.weight"]]
    convert_file_size_to_int("5GB")  # 5_000_000_000
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """What identifies the memory under ``tensor``: tensors with the same triple share storage (tied weights)."""
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr() if tensor.device.type != "meta" else id(storage)
    return tensor.device, pointer, storage.nbytes()


def find_tied_parameters(model: nn.Module, **kwargs: object) -> list[list[str]]:
    """Groups (sorted names) of parameters of ``model`` that are the same tensor."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def dtype_byte_size(dtype: torch.dtype) -> float:
    """Bytes per element of ``dtype`` (1/8 for bool)."""
    if dtype == torch.bool:
        return 1 / 8
    return float(torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8)


def convert_file_size_to_int(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"5GiB"`` -> 5 * 2**30 (``"5Gb"``: bits), an int as it is."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size, re.IGNORECASE)
    if match is None:
        raise ValueError(f"size {size!r} is not an integer or a number with a unit; use e.g. '5GB', '500MiB'")
    value, unit = float(match.group(1)), match.group(2)
    power = "KMG".index(unit[0].upper()) + 1
    scale = 2 ** (10 * power) if unit[1].upper() == "I" else 10 ** (3 * power)
    result = int(value * scale)
    return result // 8 if unit.endswith("b") else result


def compute_module_sizes(model: nn.Module, dtype: torch.dtype | None = None,
                         **kwargs: object) -> dict[str, int]:
    """Bytes held by each submodule (by name; ``""`` is the whole model), parameters and buffers, counted in
    ``dtype`` where given (floating tensors only)."""
    sizes: dict[str, int] = defaultdict(int)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        size_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = int(tensor.numel() * dtype_byte_size(size_dtype))
        parts = name.split(".")
        for i in range(len(parts) + 1):
            sizes[".".join(parts[:i])] += size
    return dict(sizes)


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a PEFT model (peft installed and a ``PeftModel``)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every submodule of ``model`` (itself last), children before their parents; with ``return_fqns`` the
    ``(name, module)`` pairs."""
    order: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)
        order.append((prefix, module))

    visit("", model)
    return order if return_fqns else [m for _, m in order]


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a ``DTensor`` (FSDP2 / tensor parallelism sharded it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
