"""DistributedDataParallel over the default process group (gloo on CPU, nccl on CUDA)."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from impel.config.ddp_hooks import reduction_dtype, register_comm_hook
from impel.strategies.base import Strategy

if TYPE_CHECKING:
    from impel.runtime.step.precision_report import PrecisionReport


@contextlib.contextmanager
def _own_no_sync(model: DistributedDataParallel) -> Iterator[None]:
    """``model.no_sync()`` on a prepared DDP model: no gradient sync for forwards inside it, as in plain DDP."""
    before = model.require_backward_grad_sync
    own = vars(model)  # impel's flags live in the instance __dict__ (where Module.__setattr__ would put them)
    own["_impel_own_no_sync"] = own.get("_impel_own_no_sync", 0) + 1
    model.require_backward_grad_sync = False
    try:
        yield
    finally:
        own["_impel_own_no_sync"] -= 1
        if not own["_impel_own_no_sync"]:  # back to what impel wants now (accumulation may have moved on)
            model.require_backward_grad_sync = own.get("_impel_sync_wanted", before)


class DDPStrategy(Strategy):
    name = "MULTI_CPU"
    uses_ddp = True

    def wrap_model(self, model: nn.Module, device_placement: bool) -> nn.Module:
        model = super().wrap_model(model, device_placement)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (teacher, EMA) has nothing to reduce
        if self.parallelism is not None and self.parallelism.tp_enabled:
            return model  # every rank is tensor parallel (replication needs dp_shard, i.e. FSDP): nothing to reduce
        kwargs = self.handlers.ddp.to_kwargs() if self.handlers.ddp else {}
        if self.device.type == "cuda":
            kwargs.setdefault("device_ids", [self.device.index])
            kwargs.setdefault("output_device", self.device.index)
        wrapped = DistributedDataParallel(model, **kwargs)
        register_comm_hook(wrapped, self.handlers.ddp)  # before the first backward, as torch requires
        # impel's forward sets DDP's sync flag on every call; the model's own no_sync() must still hold inside it
        # (an instance attribute over DDP's method, in __dict__ as Module.__setattr__ would store it)
        vars(wrapped)["no_sync"] = functools.partial(_own_no_sync, wrapped)
        return wrapped

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def forced_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._forced_sync(model)

    @contextlib.contextmanager
    def _forced_sync(self, model: nn.Module) -> Iterator[None]:
        """As Accelerate's ``trigger_sync_in_backward``: DDP reduces in the next backward (its reducer is told
        to expect one), then the flags are back as they were."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        before = (model.require_backward_grad_sync, model.require_forward_param_sync)
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        if isinstance(model, DistributedDataParallel):
            # DDP reads this flag when forward prepares the reducer; flipping it is what no_sync() does.
            own = vars(model)
            own["_impel_sync_wanted"] = enabled
            model.require_backward_grad_sync = enabled and not own.get("_impel_own_no_sync", 0)

    def precision_report(self, models: Sequence[nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer]) -> PrecisionReport:
        report = super().precision_report(models, optimizers)
        compressed = reduction_dtype(self.handlers.ddp)
        if compressed is None or report.reduction is None:
            return report
        return replace(report, reduction=compressed, note=f"DDP comm hook all-reduces gradients in {compressed}")
