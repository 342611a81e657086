"""Gradient accumulation bookkeeping: which micro-step we are in and whether it ends a group.

A micro-step begins when ``accumulate()`` is entered, or, for loops that do not use it, at the first training
forward of a prepared model (or at ``backward()``) after the previous backward. It syncs (all-reduces and lets
the optimizer step) when its group is full or when the prepared dataloader it reads from is on its last batch.
Groups are normally ``num_steps`` long; the last group of an epoch is as long as the batches that remain. The loss
is divided by ``num_steps`` in every group, the short last one included, as Accelerate does;
``GradientAccumulationPlugin(short_group_divisor="actual")`` divides by the group's real length instead, so a short
final group still produces a mean gradient.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

from impel.config.plugins import GradientAccumulationPlugin
from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("impel")


class GradientState:
    """The accumulation state of one Accelerator, read by the prepared model, optimizer, scheduler and dataloaders.

    Its fields change only through its methods, so the accumulation rules live here alone:
    micro-steps (:meth:`begin`, :meth:`begin_auto` / :meth:`end_auto`, :meth:`enter_accumulate` /
    :meth:`exit_accumulate`), the dataloaders being iterated (:meth:`register_dataloader` /
    :meth:`unregister_dataloader`), user ``no_sync()`` blocks (:meth:`no_sync_block`), and the settings Accelerate
    lets a loop change (:meth:`set_accumulation_steps`, :meth:`set_sync_gradients`, :meth:`set_step`).

    ``GradientState()`` without a plugin is Accelerate's shared state: the gradient state of the newest Accelerator
    still alive (one with ``num_steps=1`` when there is none), so ``GradientState().sync_gradients`` reads what the
    training loop sees.

    What every step reads (``num_steps``, ``sync_gradients``, ``grad_sync_enabled``, ``item_scale``,
    ``in_micro_step``) are read-only properties whose getter is C (``operator.attrgetter``): no Python call.
    """

    _newest: ClassVar[weakref.ref[GradientState] | None] = None

    def __new__(cls, plugin: GradientAccumulationPlugin | None = None) -> GradientState:
        shared = cls._newest() if plugin is None and cls._newest is not None else None
        return shared if shared is not None else super().__new__(cls)

    def __init__(self, plugin: GradientAccumulationPlugin | None = None) -> None:
        if plugin is None and getattr(self, "_plugin", None) is not None:
            return  # the shared state (see __new__), already built
        if plugin is not None:
            type(self)._newest = weakref.ref(self)
        self._plugin = plugin or GradientAccumulationPlugin()
        self._num_steps: int = self._plugin.num_steps or 1  # resolve() fills a plugin's None from the launch
        self._sync = True
        self._grad_sync = True  # the next backward reduces gradients across ranks: see _set_sync
        self._group_size = self._num_steps
        self._micro = 0  # micro-steps done in the current group
        self._in_context = False  # inside accumulate()
        self._open = False  # an automatic micro-step has begun and has not seen its backward yet
        self._in_micro_step = False  # _in_context or _open: callers skip begin_auto() without a call
        self._no_sync_depth = 0  # depth of user no_sync() blocks
        self._dataloaders: list[Any] = []
        self._saw_backward = True  # accelerator.backward() ran in the current micro-step
        self._warned_direct_backward = False
        self._step = 0  # Accelerate's ``accelerator.step``: micro-steps begun, reset when one ends a dataloader
        self._planned_group: int | None = None  # item_windows(): the window read ahead decides the group
        # item_windows(): this batch's loss multiplier, replacing the division
        self._item_scale: torch.Tensor | None = None

    @staticmethod
    def _reset_state() -> None:
        """Accelerate's reset (test suites call it): until another Accelerator is built, ``GradientState()`` is a
        fresh state again; live Accelerators keep theirs."""
        GradientState._newest = None

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as its values, never as the shared instance
        state = {k: v for k, v in self.__dict__.items() if k != "_dataloaders"}
        return (_rebuild, (self._plugin, state))

    # --- what the loop and Accelerate's users read ------------------------------------------------------------
    num_steps = property(attrgetter("_num_steps"), doc="Micro-steps per optimizer step.")
    sync_gradients = property(attrgetter("_sync"), doc="This micro-step ends a group: the optimizer steps.")
    grad_sync_enabled = property(attrgetter("_grad_sync"),
                                 doc="The next backward reduces gradients across ranks (not inside no_sync()).")
    item_scale = property(attrgetter("_item_scale"), doc="item_windows(): this batch's loss multiplier, or None.")
    in_micro_step = property(attrgetter("_in_micro_step"),
                             doc="Inside accumulate(), or an automatic micro-step is open (begin_auto is a no-op).")

    @property
    def plugin(self) -> GradientAccumulationPlugin:
        return self._plugin

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        """The plugin's values that differ from its defaults (Accelerate's ``to_kwargs``)."""
        default = GradientAccumulationPlugin()
        return {f.name: getattr(self._plugin, f.name) for f in dataclasses.fields(self._plugin)
                if getattr(self._plugin, f.name) != getattr(default, f.name)}

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self._plugin.sync_with_dataloader)

    @property
    def adjust_scheduler(self) -> bool:
        return bool(self._plugin.adjust_scheduler)

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def micro_in_group(self) -> int:
        return self._micro

    @property
    def step(self) -> int:
        return self._step

    @property
    def manual_no_sync(self) -> bool:
        """Inside a user ``no_sync()`` block."""
        return self._no_sync_depth > 0

    @property
    def active_dataloaders(self) -> tuple[Any, ...]:
        return tuple(self._dataloaders)

    @property
    def dataloader_references(self) -> list[Any]:
        return [None, *self._dataloaders]  # Accelerate's list starts with None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._dataloaders)

    @property
    def active_dataloader(self) -> Any:
        return self._dataloaders[-1] if self._dataloaders else None

    @property
    def end_of_dataloader(self) -> bool:
        dl = self.active_dataloader
        return bool(dl is not None and dl.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the current global batch when it is the padded last one, else -1."""
        dl = self.active_dataloader
        return dl.remainder if dl is not None and dl.end_of_dataloader else -1

    # --- the settings a loop may change -----------------------------------------------------------------------
    def set_accumulation_steps(self, value: int) -> None:
        """``accelerator.gradient_accumulation_steps = value``: between optimizer steps only."""
        if self._micro:
            raise ConfigError(f"gradient_accumulation_steps={value} set in the middle of an accumulation group (micro-"
                              f"step {self._micro} of {self._group_size}); set it between optimizer steps")
        self._num_steps = self._group_size = value

    def set_sync_gradients(self, value: bool) -> None:
        """Until the next micro-step begins, as in Accelerate."""
        self._set_sync(value)

    def _set_sync(self, value: bool) -> None:
        self._sync = value
        self._grad_sync = not self._no_sync_depth and (value or bool(self._plugin.sync_each_batch))

    _set_sync_gradients = set_sync_gradients  # Accelerate's name

    def set_step(self, value: int) -> None:
        self._step = int(value)

    # --- item_windows(): token-level losses -------------------------------------------------------------------
    def set_item_window(self, length: int | None, item_scale: torch.Tensor | None = None) -> None:
        """The window ``item_windows()`` read ahead (its length decides the group, whatever the dataloader's end
        flag says) and the multiplier of the batch it yields; ``(None, None)`` when it is done."""
        self._planned_group = length
        self._item_scale = item_scale

    # --- dataloaders being iterated ---------------------------------------------------------------------------
    def register_dataloader(self, dataloader: object) -> None:
        self._dataloaders.append(dataloader)

    def unregister_dataloader(self, dataloader: object) -> None:
        if dataloader in self._dataloaders:
            self._dataloaders.remove(dataloader)

    _add_dataloader, _remove_dataloader = register_dataloader, unregister_dataloader  # Accelerate's names

    # --- user no_sync() blocks --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync_block(self) -> Iterator[None]:
        self._no_sync_depth += 1
        self._set_sync(self._sync)
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._set_sync(self._sync)

    # --- micro-steps ------------------------------------------------------------------------------------------
    def begin(self) -> None:
        dataloaders = self._dataloaders  # (end_of_dataloader, inlined: this runs on every micro-step)
        at_end = self._plugin.sync_with_dataloader and bool(dataloaders) and dataloaders[-1].end_of_dataloader
        self._step = 0 if at_end else self._step + 1
        at_end = at_end and self._planned_group is None  # item_windows() read the window ahead: it decides
        if self._num_steps == 1:
            if not self._sync:
                self._set_sync(True)
            self._group_size = 1
            return
        self._saw_backward = False
        if self._micro == 0:
            self._group_size = self._planned_group or self._next_group_size()
        self._micro += 1
        sync = self._micro >= self._group_size or at_end
        self._sync = sync  # (_set_sync, inlined)
        self._grad_sync = not self._no_sync_depth and (sync or bool(self._plugin.sync_each_batch))
        if sync:
            self._micro = 0

    def _next_group_size(self) -> int:
        dl = self.active_dataloader
        if dl is None or not self._plugin.sync_with_dataloader:
            return self._num_steps
        remaining = dl.remaining_batches()
        return self._num_steps if remaining is None else max(1, min(self._num_steps, remaining))

    def begin_auto(self) -> None:
        """Open a micro-step for loops that do not use ``accumulate()``; a no-op while one is open."""
        if not self._in_micro_step:
            self.begin()
            self._open = self._in_micro_step = True

    def end_auto(self) -> None:
        if not self._in_context:
            self._open = self._in_micro_step = False

    def enter_accumulate(self) -> None:
        """``with accelerator.accumulate(model):`` begins a micro-step that lasts for the block."""
        self.begin()
        self._in_context = self._in_micro_step = True
        self._open = False

    def exit_accumulate(self) -> None:
        self._in_context = self._in_micro_step = False

    def on_optimizer_step(self) -> None:
        """The prepared optimizer's step ends an automatic micro-step even if backward bypassed impel."""
        if self._num_steps > 1 and not self._saw_backward and not self._warned_direct_backward:
            self._warned_direct_backward = True
            logger.warning("gradient_accumulation_steps=%d but this micro-step's backward did not go through "
                           "accelerator.backward(loss): the loss was not divided by the group length, so the "
                           "accumulated gradient is a sum; call accelerator.backward(loss) instead of "
                           "loss.backward()", self._num_steps)
        if self._open:
            self.end_auto()

    @property
    def loss_divisor(self) -> int:
        """``num_steps`` (Accelerate's), or the group's real length with ``short_group_divisor="actual"``."""
        return self._group_size if self._plugin.short_group_divisor == "actual" else self._num_steps

    def scale_loss(self, loss: Any) -> Any:
        """Divide by :attr:`loss_divisor` (under item_windows(): multiply by this batch's share of the window's loss
        items on all ranks, times the processes) and note that this micro-step's backward went through impel."""
        self._saw_backward = True
        if self._item_scale is not None:
            return loss * self._item_scale.to(loss.dtype)
        return loss / (self._group_size if self._plugin.short_group_divisor == "actual" else self._num_steps)

    def state_dict(self) -> dict[str, int]:
        return {"micro_in_group": self._micro, "group_size": self._group_size, "step": self._step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._micro = int(state.get("micro_in_group", 0))
        self._group_size = int(state.get("group_size", self._num_steps))
        self._step = int(state.get("step", 0))


def _rebuild(plugin: GradientAccumulationPlugin, state: dict[str, Any]) -> GradientState:
    out = object.__new__(GradientState)
    out.__dict__.update(state, _plugin=plugin, _dataloaders=[])
    return out


class MicroStep:
    """``with accelerator.accumulate(model):`` as a plain class: it runs on every micro-step, so no generator."""

    __slots__ = ("state",)  # one per Accelerator, entered on every micro-step

    def __init__(self, state: GradientState) -> None:
        self.state = state

    def __enter__(self) -> None:
        self.state.enter_accumulate()

    def __exit__(self, *exc: object) -> None:
        self.state.exit_accumulate()
