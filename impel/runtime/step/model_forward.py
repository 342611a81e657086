"""The prepared model's forward: accumulation bookkeeping, the gradient-sync switch, autocast, and (under mixed
precision, as Accelerate and Lightning Fabric do) floating outputs cast to fp32, so that a loss computed outside
the model is computed in fp32. ``Accelerator(cast_outputs_to_fp32=False)`` skips the cast.

impel replaces ``forward`` on the instance (the class is untouched) with a :class:`PreparedForward` bound to the
model, so ``copy.deepcopy`` of a prepared model rebinds to the copy, the model pickles (a plain bound method of a
module-level function would not), ``inspect.signature(model.forward)`` is the original's (``__wrapped__``, as
Accelerate's fp32 wrapper), and ``unwrap_model(..., keep_fp32_wrapper=False)`` restores the original.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

from impel.runtime.ranks.collectives import recursively_apply
from impel.runtime.step.accumulation import GradientState

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class GradSyncControl(Protocol):
    """What a prepared forward asks of the strategy (``impel.strategies.base:Strategy.set_grad_sync``)."""

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None: ...


def outputs_to_fp32(outputs: object) -> Any:
    """fp16/bf16 tensors in (nested) outputs become fp32; everything else is returned as it is."""
    return recursively_apply(lambda t: t.float() if t.dtype in _LOW_PRECISION else t, outputs,
                             error_on_other_type=False)


class ForwardContext:
    """What a prepared forward needs; shared, never copied with the model."""

    def __init__(self, strategy: GradSyncControl, gradient_state: GradientState,
                 autocast: Callable[[], AbstractContextManager[object]] | None, track: bool,
                 cast_outputs: bool = False) -> None:
        self.strategy = strategy
        self.gradient_state = gradient_state
        self.autocast = autocast
        self.track = track  # the outermost module decides gradient sync for its backward
        self.cast_outputs = cast_outputs  # the outermost module returns fp32 to the loop
        self.sync_state: bool | None = None

    def before_forward(self, model: nn.Module) -> None:
        gs = self.gradient_state
        if gs.num_steps > 1 and not gs.in_micro_step and model.training and torch.is_grad_enabled():
            gs.begin_auto()
        sync = gs.grad_sync_enabled
        if sync is not self.sync_state:
            self.strategy.set_grad_sync(model, sync)
            self.sync_state = sync

    def __deepcopy__(self, memo: dict[int, object]) -> ForwardContext:
        return self


class PreparedForward:
    """A prepared model's ``forward``: bound to the model like a method, picklable and deep-copyable with it."""

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    @property
    def __wrapped__(self) -> Callable[..., object]:
        """The forward underneath (``inspect.signature`` follows it)."""
        return self.__self__.__dict__["_impel_original_forward"]

    def __call__(self, *args: object, **kwargs: object) -> Any:
        model = self.__self__
        ctx: ForwardContext = model.__dict__["_impel_ctx"]
        original: Callable[..., object] = model.__dict__["_impel_original_forward"]  # where patch_forward put both
        if ctx.track:
            ctx.before_forward(model)
        if ctx.autocast is None:
            outputs = original(*args, **kwargs)
        else:
            with ctx.autocast():
                outputs = original(*args, **kwargs)
        return outputs_to_fp32(outputs) if ctx.cast_outputs else outputs


def patch_forward(model: nn.Module, ctx: ForwardContext) -> None:
    if "_impel_ctx" in model.__dict__:
        model.__dict__["_impel_ctx"] = ctx
        return
    if "forward" in model.__dict__:  # someone already patched this instance: keep theirs underneath ours
        model.__dict__["_impel_user_forward"] = model.__dict__["forward"]
    model.__dict__["_impel_original_forward"] = model.forward
    model.__dict__["_impel_ctx"] = ctx
    model.__dict__["forward"] = PreparedForward(model)


def unpatch_forward(model: nn.Module) -> nn.Module:
    for name in ("forward", "_impel_original_forward", "_impel_ctx"):
        model.__dict__.pop(name, None)
    if "_impel_user_forward" in model.__dict__:
        model.__dict__["forward"] = model.__dict__.pop("_impel_user_forward")
    return model


def is_prepared(model: nn.Module) -> bool:
    return "_impel_ctx" in model.__dict__
