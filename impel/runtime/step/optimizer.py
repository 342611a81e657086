"""Prepared optimizer and scheduler.

The optimizer's ``step()`` and ``zero_grad()`` are no-ops on micro-steps that do not end an accumulation group,
apply the fp16 scaler through the strategy, and record whether the step was skipped. The scheduler steps as
Accelerate's does, because Accelerate scripts size their schedules for it: ``steps_per_update`` times (the
number of processes, or 1 with ``split_batches`` or ``Accelerator(step_scheduler_per_process=False)``) per
optimizer step that really happened; never on skipped fp16 steps or on micro-steps.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from impel.runtime.step.accumulation import GradientState


class OptimizerSteps(Protocol):
    """What the prepared optimizer asks of the strategy (``impel.strategies.base:Strategy``'s methods)."""

    def plain_optimizer_calls(self) -> bool: ...
    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None: ...
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> bool: ...


class StepGuard(Protocol):
    """Decides whether a step may run (``impel.accelerator.resilience:Resilience`` with ``nonfinite_loss``)."""

    def allow_step(self, optimizer: AcceleratedOptimizer) -> bool: ...


def optimizer_owners(models: Sequence[torch.nn.Module],
                     optimizers: Sequence[torch.optim.Optimizer]) -> list[int | None]:
    """For each optimizer, the index of the model that owns all its parameters (None when no single one does)."""
    owned = [{id(p) for p in m.parameters()} for m in models]
    owners: list[int | None] = []
    for opt in optimizers:
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        owners.append(next((i for i, mine in enumerate(owned) if params <= mine), None))
    return owners


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a user's optimizer; everything not overridden reads through to it."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: OptimizerSteps, gradient_state: GradientState,
                 guard: StepGuard | None = None) -> None:
        # Deliberately no super().__init__: this object is a view on ``optimizer``, which owns the state.
        self.optimizer = optimizer
        self.strategy = strategy
        self.gradient_state = gradient_state
        self.step_was_skipped = False
        self.steps_taken = 0
        self.guard = guard  # impel.accelerator.resilience.Resilience when nonfinite_loss is checked, else None
        # resolved once: torch's step / zero_grad called directly when the strategy would only forward them
        plain = getattr(strategy, "plain_optimizer_calls", None)
        self.plain_calls = bool(plain()) if plain is not None else False

    # torch.optim.Optimizer fields, read through
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if self.plain_calls:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.strategy.zero_grad(self.optimizer, set_to_none=set_to_none)

    # None even with a closure, as Accelerate's AcceleratedOptimizer.step (torch's returns the closure's loss)
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        gs = self.gradient_state
        if gs.num_steps > 1:
            gs.on_optimizer_step()
        if not gs.sync_gradients:
            return
        if self.guard is not None and not self.guard.allow_step(self):
            self.step_was_skipped = True
            return
        if self.plain_calls:
            self.optimizer.step() if closure is None else self.optimizer.step(closure)
            self.step_was_skipped = False
            self.steps_taken += 1
            return
        stepped = self.strategy.optimizer_step(self.optimizer, closure)
        self.step_was_skipped = not stepped
        if stepped:
            self.steps_taken += 1
        return

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> dict[str, object]:
        return self.__dict__.copy()

    def __setstate__(self, state: Mapping[str, object]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Steps the wrapped scheduler ``steps_per_update`` times per real optimizer step (see module docstring).

    ``step_with_optimizer=False``: every call steps, whatever the optimizer did. On a micro-step that does not end
    an accumulation group nothing steps (whatever ``adjust_scheduler`` says: in Accelerate 1.15 its micro-step
    branch never runs, since the plugin only passes on non-default values and the state reads a False default).
    """

    def __init__(self, scheduler: Any, optimizers: Sequence[AcceleratedOptimizer], gradient_state: GradientState,
                 step_with_optimizer: bool = True, steps_per_update: int = 1) -> None:
        if isinstance(steps_per_update, bool) or not isinstance(steps_per_update, int) or steps_per_update < 1:
            raise ValueError(f"steps_per_update={steps_per_update!r} must be an integer >= 1")
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_update = steps_per_update

    def step(self, *args: Any, **kwargs: object) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end: stop there
        for _ in range(self.steps_per_update):
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: object, **kwargs: object) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
