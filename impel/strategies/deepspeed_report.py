"""``accelerator.precision_report()`` under DeepSpeed: the seed's dtype row, read from the live engines.

DeepSpeed keeps two copies of the weights. The module's working copy (what forward uses) is in the engine's
dtype: bfloat16/float16 under those modes, float32 otherwise. The master weights the optimizer updates (ZeRO's
flat partitions, or BF16_Optimizer's) are float32 in every mode, as are the optimizer states: that is the
``stored_params`` row here, and a model loaded in 16 bits is upcast to them at prepare.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from impel.runtime.step.precision_report import (
    DtypeField,
    PrecisionReport,
    dtype_of,
    optimizer_state_dtype,
    predicted_state_dtype,
)

if TYPE_CHECKING:
    from impel.config.deepspeed_json import Resolved
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.precision import Precision


class ReportedStrategy(Protocol):
    """What :func:`engine_report` reads of the DeepSpeed strategy (a Protocol: :mod:`impel.strategies.deepspeed`
    imports this module, not the other way round)."""

    deepspeed: Any  # the deepspeed package
    train_engine: Any

    def resolved_for(self, engine: object) -> Resolved: ...
    state: ProcessState
    precision: Precision
    _load_dtypes: dict[int, DtypeField]
    _upcast: bool


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "/".join(_show(v) for v in value)
    return str(value).replace("torch.", "")


def engine_report(strategy: ReportedStrategy, models: Sequence[nn.Module],
                  optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
    """Master weights and optimizer states from the optimizers' tensors, compute from the engine's config."""
    engines = [m for m in models if isinstance(m, strategy.deepspeed.DeepSpeedEngine)]
    working = dtype_of(p for e in engines for p in e.module.parameters())
    engine = strategy.train_engine or (engines[0] if engines else None)
    masters = dtype_of(_master_tensors(engine, optimizers)) or working
    states = optimizer_state_dtype(optimizers) or predicted_state_dtype(optimizers) or masters
    resolved = strategy.resolved_for(engine)  # the trained engine's plugin (several plugins may differ in stage)
    compute = resolved.dtype
    gradients = engine.get_data_types()[1] if engine is not None else None
    reduction = engine.communication_data_type if engine is not None and strategy.state.use_distributed else None
    loaded = sorted({str(d) for e in engines for d in _as_tuple(strategy._load_dtypes.get(id(e)))})
    note = (f"ZeRO stage {resolved.stage}; module working copy {_show(working)}, master weights "
            f"{_show(masters)} updated by the optimizer step")
    if loaded:
        note += f"; loaded as {_show(tuple(loaded))}" + (", upcast to float32 at prepare" if strategy._upcast else "")
    return PrecisionReport(strategy=f"DEEPSPEED ZeRO-{resolved.stage}",
                           mixed_precision=strategy.precision.mode, stored_params=masters, compute=compute,
                           gradients=gradients, reduction=reduction, optimizer_states=states, note=note)


def _as_tuple(value: DtypeField) -> tuple[torch.dtype, ...]:
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)


# Where DeepSpeed's optimizer wrappers keep their float32 master partitions: ZeRO-3, ZeRO-1/2, BF16_Optimizer.
_MASTER_ATTRIBUTES = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def _master_tensors(engine: object, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors the optimizer step updates. ZeRO-3 empties the torch optimizer's groups between steps, so the
    wrapper's partitions are read first; without a wrapper they are the torch optimizer's parameters."""
    wrapper = getattr(engine, "optimizer", None)
    for name in _MASTER_ATTRIBUTES:
        found = getattr(wrapper, name, None)
        if found:
            return [t for t in found if isinstance(t, torch.Tensor)]
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
