"""DistributedDataParallel over the default process group (gloo on CPU, nccl on CUDA)."""
from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy


class DDPStrategy(Strategy):
    name = "MULTI_CPU"

    def wrap_model(self, model: nn.Module, device_placement: bool) -> nn.Module:
        model = super().wrap_model(model, device_placement)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (teacher, EMA) has nothing to reduce
        kwargs = self.handlers.ddp.to_kwargs() if self.handlers.ddp else {}
        if self.device.type == "cuda":
            kwargs.setdefault("device_ids", [self.device.index])
            kwargs.setdefault("output_device", self.device.index)
        return DistributedDataParallel(model, **kwargs)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        if isinstance(model, DistributedDataParallel):
            # DDP reads this flag when forward prepares the reducer; flipping it is what no_sync() does.
            model.require_backward_grad_sync = enabled
