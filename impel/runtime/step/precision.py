"""Mixed precision: one small object per mode, owned by the strategy.

``no``: plain fp32 (or whatever dtype the model was loaded in). ``bf16``: autocast to bfloat16, no scaler.
``fp16``: autocast to float16 with a GradScaler (torch's CPU scaler on CPU). The prepared forward casts floating
outputs back to fp32 (:mod:`impel.runtime.step.model_forward`; ``cast_outputs_to_fp32=False`` skips it), as Accelerate
does.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from impel.config.plugins import AutocastKwargs, GradScalerKwargs


class Precision:
    """No mixed precision: forward runs as is, backward is plain, the optimizer always steps."""

    mode = "no"
    dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    def __init__(self, device: torch.device, autocast_kwargs: AutocastKwargs | None = None,
                 scaler_kwargs: GradScalerKwargs | None = None) -> None:
        self.device = device
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()

    def autocast(self, enabled: bool | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: object) -> None:
        loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Step the optimizer; return False when the step was skipped (non-finite fp16 gradients)."""
        if closure is not None:
            optimizer.step(closure)
        else:
            optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class AutocastPrecision(Precision):
    """bf16: autocast to bfloat16 on CPU and CUDA; gradients need no scaling."""

    mode = "bf16"
    dtype = torch.bfloat16

    def autocast(self, enabled: bool | None = None) -> contextlib.AbstractContextManager[None]:
        kw = self.autocast_kwargs
        on = kw.enabled if enabled is None else enabled
        extra = {} if kw.cache_enabled is None else {"cache_enabled": kw.cache_enabled}
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, enabled=on, **extra)


class ScaledPrecision(AutocastPrecision):
    """fp16: autocast to float16 plus a GradScaler; skipped steps are reported."""

    mode = "fp16"
    dtype = torch.float16

    scaler: torch.amp.GradScaler

    def __init__(self, device: torch.device, autocast_kwargs: AutocastKwargs | None = None,
                 scaler_kwargs: GradScalerKwargs | None = None) -> None:
        super().__init__(device, autocast_kwargs)
        kw = (scaler_kwargs or GradScalerKwargs()).to_kwargs()
        self.scaler = torch.amp.GradScaler(device.type, **kw)
        self._unscaled: set[int] = set()
        self._scaled = False  # no loss scaled yet: no gradient is scaled, nothing to unscale

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._scaled = True
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # before any backward torch's scaler has no scale yet and asserts; Accelerate's clip_grad_norm_ then
        # returns 0 (there are no gradients), and so does impel's
        if self._scaled and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, closure: object = None) -> bool:
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer) if closure is None else self.scaler.step(optimizer, closure)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        # GradScaler lowers the scale exactly when it skipped the step for inf/nan gradients.
        return not self.scaler.is_enabled() or self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


_MODES = {"no": Precision, "bf16": AutocastPrecision, "fp16": ScaledPrecision}


def make_precision(mode: str, device: torch.device, autocast_kwargs: AutocastKwargs | None = None,
                   scaler_kwargs: GradScalerKwargs | None = None) -> Precision:
    try:
        cls = _MODES[mode]
    except KeyError:
        raise ValueError(f"mixed_precision={mode!r} is not supported; use 'no', 'fp16' or 'bf16'") from None
    return cls(device, autocast_kwargs, scaler_kwargs)
