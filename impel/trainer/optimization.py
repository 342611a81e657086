"""Which parameters get weight decay, and the optimizer's parameter groups (transformers' rule).

Example::

    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.01), lr=5e-5)
"""
from __future__ import annotations

from typing import Any

from torch import nn


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Parameters that get weight decay: all but biases and normalisation weights (transformers' rule)."""
    no_decay: set[str] = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if is_norm or "bias" in name.lower() or "norm" in full.lower().replace("_", ""):
                no_decay.add(full)
    return {name for name, _ in model.named_parameters() if name not in no_decay}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups of the trainable parameters: with ``weight_decay``, and without (biases, norm weights)."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
