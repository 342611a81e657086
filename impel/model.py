"""The prepared model's forward: accumulation bookkeeping, the gradient-sync switch and autocast.

impel replaces ``forward`` on the instance (the class is untouched) with a bound method, so ``copy.deepcopy`` of
a prepared model rebinds to the copy, and ``unwrap_model(..., keep_fp32_wrapper=False)`` restores the original.
"""
from __future__ import annotations

import types
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .accumulation import GradientState


class ForwardContext:
    """What a prepared forward needs; shared, never copied with the model."""

    def __init__(self, strategy: Any, gradient_state: GradientState,
                 autocast: Callable[[], ContextManager[Any]] | None, track: bool) -> None:
        self.strategy = strategy
        self.gradient_state = gradient_state
        self.autocast = autocast
        self.track = track  # the outermost module decides gradient sync for its backward
        self.sync_state: bool | None = None

    def before_forward(self, model: nn.Module) -> None:
        gs = self.gradient_state
        if gs.num_steps > 1 and model.training and torch.is_grad_enabled():
            gs.begin_auto()
        sync = gs.grad_sync_enabled
        if sync is not self.sync_state:
            self.strategy.set_grad_sync(model, sync)
            self.sync_state = sync

    def __deepcopy__(self, memo: dict[int, Any]) -> "ForwardContext":
        return self


def _prepared_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    ctx: ForwardContext = self.__dict__["_impel_ctx"]
    if ctx.track:
        ctx.before_forward(self)
    if ctx.autocast is None:
        return self._impel_original_forward(*args, **kwargs)
    with ctx.autocast():
        return self._impel_original_forward(*args, **kwargs)


def patch_forward(model: nn.Module, ctx: ForwardContext) -> None:
    if "_impel_ctx" in model.__dict__:
        model.__dict__["_impel_ctx"] = ctx
        return
    if "forward" in model.__dict__:  # someone already patched this instance: keep theirs underneath ours
        model.__dict__["_impel_user_forward"] = model.__dict__["forward"]
    model.__dict__["_impel_original_forward"] = model.forward
    model.__dict__["_impel_ctx"] = ctx
    model.__dict__["forward"] = types.MethodType(_prepared_forward, model)


def unpatch_forward(model: nn.Module) -> nn.Module:
    for name in ("forward", "_impel_original_forward", "_impel_ctx"):
        model.__dict__.pop(name, None)
    if "_impel_user_forward" in model.__dict__:
        model.__dict__["forward"] = model.__dict__.pop("_impel_user_forward")
    return model


def is_prepared(model: nn.Module) -> bool:
    return "_impel_ctx" in model.__dict__
