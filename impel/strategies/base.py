"""The Strategy contract: every difference between single device, DDP, FSDP2 and DeepSpeed lives behind it.

The Accelerator (the facade) only calls these methods; it never asks which strategy it holds. A strategy owns
the precision object, wraps models and optimizers (together, because FSDP2 replaces parameters and DeepSpeed
builds an engine from both), switches gradient synchronisation for accumulation, runs backward, clips, steps
and produces full state dicts. New strategies register a dotted path in ``REGISTRY``; the facade is untouched.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from torch import nn

from ..config import ConfigError
from ..precision import Precision, make_precision

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..plugins import Handlers
    from ..state import ProcessState

REGISTRY: dict[str, str] = {
    "NO": "impel.strategies.single:SingleDeviceStrategy",
    "MULTI_CPU": "impel.strategies.ddp:DDPStrategy",
    "MULTI_GPU": "impel.strategies.ddp:DDPStrategy",
    "FSDP": "impel.strategies.fsdp:FSDPStrategy",
    "DEEPSPEED": "impel.strategies.deepspeed:DeepSpeedStrategy",
}


class Strategy:
    """Base strategy: a model on one device, plain backward, local optimizer step."""

    name = "NO"

    def __init__(self, state: "ProcessState", config: "RunConfig", handlers: "Handlers") -> None:
        self.state = state
        self.config = config
        self.handlers = handlers
        self.device: torch.device = state.device
        self.precision: Precision = make_precision(config.mixed_precision, state.device, handlers.autocast,
                                                   handlers.scaler)

    # --- wrapping -------------------------------------------------------------------------------------------
    def setup(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              device_placement: Sequence[bool]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
        """Wrap the models and optimizers handed to one ``prepare`` call; return them in the same order.

        ``device_placement[i]`` says whether model i is moved to the device.
        """
        wrapped = [self.wrap_model(m, place) for m, place in zip(models, device_placement)]
        return wrapped, [self.wrap_optimizer(o) for o in optimizers]

    def wrap_model(self, model: nn.Module, device_placement: bool) -> nn.Module:
        if device_placement:
            model = model.to(self.device)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module without any distributed wrapper."""
        return model

    # --- the training step ----------------------------------------------------------------------------------
    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Turn the cross-rank gradient reduction of the next backward on or off (accumulation)."""
        return None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.precision.backward(loss, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.unscale_(optimizer)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                        optimizers: Sequence[torch.optim.Optimizer]) -> torch.Tensor:
        for opt in optimizers:
            self.unscale_gradients(opt)
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float,
                         optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            self.unscale_gradients(opt)
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Step; return False when the step was skipped (fp16 overflow)."""
        return self.precision.step(optimizer, closure)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    # --- state ----------------------------------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict of ordinary tensors (gathered where sharded)."""
        return self.unwrap_model(model).state_dict()

    def teardown(self) -> None:
        return None


def load_strategy(distributed_type: str, state: "ProcessState", config: "RunConfig",
                  handlers: "Handlers") -> Strategy:
    try:
        target = REGISTRY[distributed_type]
    except KeyError:
        raise ValueError(f"distributed_type={distributed_type!r} has no strategy; use one of {sorted(REGISTRY)}") from None
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("impel.strategies"):
            available = sorted(k for k, v in REGISTRY.items() if importlib.util.find_spec(v.partition(":")[0]))
            raise ConfigError(f"distributed_type={distributed_type!r} is not available in this impel version; "
                              f"use one of {available}") from None
        raise
    return getattr(module, cls_name)(state, config, handlers)
