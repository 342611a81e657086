"""What dtypes a prepared run actually uses: ``accelerator.precision_report()``.

Each strategy fills one :class:`PrecisionReport` from the live models and optimizers (stored parameters, gradients
and optimizer states are read from the tensors themselves; compute and reduction dtypes from the policy in effect).
A field holds one dtype, a tuple when the tensors disagree, or None when nothing of that kind exists (no gradient
reduction on one process).

Example::

    report = accelerator.precision_report()
    assert report.optimizer_states == torch.float32
    print(report)
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

DtypeField = torch.dtype | tuple | None


@dataclass
class PrecisionReport:
    """The dtype flow in effect; ``str(report)`` is a small table."""

    strategy: str
    mixed_precision: str
    stored_params: DtypeField
    compute: DtypeField
    gradients: DtypeField
    reduction: DtypeField
    optimizer_states: DtypeField
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        rows = [("stored parameters", self.stored_params), ("compute (forward/backward)", self.compute),
                ("gradients", self.gradients), ("gradient reduction", self.reduction),
                ("optimizer states", self.optimizer_states)]
        lines = [f"precision report ({self.strategy}, mixed_precision={self.mixed_precision})"]
        lines += [f"  {name:<28}{_show(value)}" for name, value in rows]
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


def _show(value: DtypeField) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return ", ".join(str(v).replace("torch.", "") for v in value)
    return str(value).replace("torch.", "")


def dtype_of(tensors: Iterable[torch.Tensor]) -> DtypeField:
    """The one floating dtype of these tensors, a sorted tuple when they mix, None when there are none."""
    found = {t.dtype for t in tensors if t.is_floating_point()}
    if not found:
        return None
    if len(found) == 1:
        return found.pop()
    return tuple(sorted(found, key=str))


def parameters_of(models: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [p for m in models for p in m.parameters()]


def optimizer_state_dtype(optimizers: Sequence[torch.optim.Optimizer]) -> DtypeField:
    """Dtype of the optimizer states that exist (scalar step counters excluded), else None."""
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dtype_of(states)


def predicted_state_dtype(optimizers: Sequence[torch.optim.Optimizer]) -> DtypeField:
    """Before the first step: torch's optimizers create their states like the parameters they update."""
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    return dtype_of(params)


def basic_report(strategy: str, mixed_precision: str, autocast_dtype: torch.dtype | None, distributed: bool,
                 models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
    """Single device and DDP: parameters, gradients and states as stored; autocast decides the compute dtype."""
    stored = dtype_of(parameters_of(models))
    grads = dtype_of(p.grad for p in parameters_of(models) if p.grad is not None) or stored
    states = optimizer_state_dtype(optimizers) or predicted_state_dtype(optimizers)
    return PrecisionReport(strategy=strategy, mixed_precision=mixed_precision, stored_params=stored,
                           compute=autocast_dtype or stored, gradients=grads,
                           reduction=grads if distributed else None, optimizer_states=states)
