"""Gradient accumulation bookkeeping: which micro-step we are in and whether it ends a group.

A micro-step begins when ``accumulate()`` is entered, or, for loops that do not use it, at the first training
forward of a prepared model (or at ``backward()``) after the previous backward. It syncs (all-reduces and lets
the optimizer step) when its group is full or when the prepared dataloader it reads from is on its last batch.
Groups are normally ``num_steps`` long; the last group of an epoch is as long as the batches that remain, and the
loss is divided by that group's real length, so a short final group still produces a mean gradient.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .plugins import GradientAccumulationPlugin

logger = logging.getLogger("impel")


class GradientState:
    """Shared by the Accelerator, the prepared model, optimizer, scheduler and dataloaders."""

    def __init__(self, plugin: GradientAccumulationPlugin | None = None) -> None:
        if plugin is None:  # Accelerate's GradientState() is a process-wide singleton; impel's is per Accelerator
            raise TypeError("GradientState() without a plugin: impel keeps one gradient state per Accelerator; "
                            "read accelerator.gradient_state instead")
        self.plugin = plugin
        self.num_steps = plugin.num_steps
        self.sync_gradients = True
        self.group_size = plugin.num_steps
        self.micro_in_group = 0
        self.in_context = False  # inside accumulate()
        self.open = False  # an automatic micro-step has begun and has not seen its backward yet
        self.manual_no_sync = 0  # depth of user no_sync() blocks
        self.active_dataloaders: list[Any] = []
        self.saw_backward = True  # accelerator.backward() ran in the current micro-step
        self.warned_direct_backward = False
        self.step = 0  # Accelerate's ``accelerator.step``: micro-steps begun, reset when one ends a dataloader
        # set by item_windows() while it yields: the current window's length and this batch's loss multiplier
        self.planned_group: int | None = None
        self.item_scale: Any = None

    # --- dataloader link --------------------------------------------------------------------------------------
    @property
    def active_dataloader(self) -> Any:
        return self.active_dataloaders[-1] if self.active_dataloaders else None

    @property
    def end_of_dataloader(self) -> bool:
        dl = self.active_dataloader
        return bool(dl is not None and dl.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the current global batch when it is the padded last one, else -1."""
        dl = self.active_dataloader
        return dl.remainder if dl is not None and dl.end_of_dataloader else -1

    # --- micro-steps ------------------------------------------------------------------------------------------
    def begin(self) -> None:
        at_end = self.plugin.sync_with_dataloader and self.end_of_dataloader
        self.step = 0 if at_end else self.step + 1
        at_end = at_end and self.planned_group is None  # item_windows() read the window ahead: it decides
        if self.num_steps == 1:
            self.sync_gradients = True
            self.group_size = 1
            return
        self.saw_backward = False
        if self.micro_in_group == 0:
            self.group_size = self.planned_group or self._next_group_size()
        self.micro_in_group += 1
        self.sync_gradients = self.micro_in_group >= self.group_size or at_end
        if self.sync_gradients:
            self.micro_in_group = 0

    def _next_group_size(self) -> int:
        dl = self.active_dataloader
        if dl is None or not self.plugin.sync_with_dataloader:
            return self.num_steps
        remaining = dl.remaining_batches()
        return self.num_steps if remaining is None else max(1, min(self.num_steps, remaining))

    def begin_auto(self) -> None:
        """Open a micro-step for loops that do not use ``accumulate()``; a no-op while one is open."""
        if not self.in_context and not self.open:
            self.begin()
            self.open = True

    def end_auto(self) -> None:
        if not self.in_context:
            self.open = False

    def on_optimizer_step(self) -> None:
        """The prepared optimizer's step ends an automatic micro-step even if backward bypassed impel."""
        if self.num_steps > 1 and not self.saw_backward and not self.warned_direct_backward:
            self.warned_direct_backward = True
            logger.warning("gradient_accumulation_steps=%d but this micro-step's backward did not go through "
                           "accelerator.backward(loss): the loss was not divided by the group length, so the "
                           "accumulated gradient is a sum; call accelerator.backward(loss) instead of "
                           "loss.backward()", self.num_steps)
        self.end_auto()

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter, which transformers' Trainer calls before each micro-batch it prefetched."""
        self.sync_gradients = bool(sync_gradients)

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """Accelerate's name: the plugin's settings (transformers' Trainer reads ``sync_each_batch``)."""
        return dataclasses.asdict(self.plugin)

    @property
    def loss_divisor(self) -> int:
        return self.group_size

    def scale_loss(self, loss: Any) -> Any:
        """Divide by the group's real length (under item_windows(): multiply by this batch's share of the window's
        loss items on all ranks, times the processes) and note that this micro-step's backward went through impel."""
        self.saw_backward = True
        if self.item_scale is not None:
            return loss * self.item_scale.to(loss.dtype)
        return loss / self.group_size

    @property
    def grad_sync_enabled(self) -> bool:
        if self.manual_no_sync:
            return False
        return self.sync_gradients or self.plugin.sync_each_batch

    def state_dict(self) -> dict[str, int]:
        return {"micro_in_group": self.micro_in_group, "group_size": self.group_size, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.micro_in_group = int(state.get("micro_in_group", 0))
        self.group_size = int(state.get("group_size", self.num_steps))
        self.step = int(state.get("step", 0))


class MicroStep:
    """``with accelerator.accumulate(model):`` as a plain class: it runs on every micro-step, so no generator."""

    __slots__ = ("state",)

    def __init__(self, state: GradientState) -> None:
        self.state = state

    def __enter__(self) -> None:
        state = self.state
        state.begin()
        state.in_context = True
        state.open = False

    def __exit__(self, *exc: object) -> None:
        self.state.in_context = False
