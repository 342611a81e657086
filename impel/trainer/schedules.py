"""Learning-rate schedules: linear, cosine, constant and constant-with-warmup, each with linear warmup.

The multipliers equal transformers' ``get_*_schedule_with_warmup`` step for step (the tests compare them). Each is
a ``LambdaLR`` over a small callable object whose fields are plain numbers, so the scheduler's ``state_dict`` loads
back with ``torch.load(weights_only=True)``. Steps count optimizer steps (impel steps the scheduler only when the
optimizer really stepped).

Example::

    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=100)
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from impel.config.run_config import ConfigError
from impel.trainer.arguments import SCHEDULER_TYPES


class ScheduleMultiplier:
    """``lr_lambda(step)`` for one schedule kind; plain fields only (they go into the scheduler's state_dict)."""

    def __init__(self, kind: str, num_warmup_steps: int, num_training_steps: int) -> None:
        self.kind = kind
        self.num_warmup_steps = int(num_warmup_steps)
        self.num_training_steps = int(num_training_steps)

    def __call__(self, step: int) -> float:
        warmup, total = self.num_warmup_steps, self.num_training_steps
        if self.kind == "constant":
            return 1.0
        if step < warmup:
            return float(step) / float(max(1, warmup))
        if self.kind == "constant_with_warmup":
            return 1.0
        if self.kind == "linear":
            return max(0.0, float(total - step) / float(max(1, total - warmup)))
        progress = float(step - warmup) / float(max(1, total - warmup))  # cosine, half a period
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)))


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0,
                  num_training_steps: int | None = None) -> LambdaLR:
    """A ``LambdaLR`` for ``name`` (linear, cosine, constant, constant_with_warmup).

    Example::

        sched = get_scheduler("linear", optim, num_warmup_steps=5, num_training_steps=50)
    """
    if name not in SCHEDULER_TYPES:
        raise ConfigError(f"lr_scheduler_type={name!r} is not allowed; use one of "
                          f"{', '.join(repr(s) for s in SCHEDULER_TYPES)}")
    if num_warmup_steps < 0:
        raise ConfigError(f"num_warmup_steps={num_warmup_steps} must be >= 0")
    if name in ("linear", "cosine") and (num_training_steps is None or num_training_steps < 1):
        raise ConfigError(f"the {name} schedule needs num_training_steps >= 1, got {num_training_steps!r}")
    return LambdaLR(optimizer, ScheduleMultiplier(name, num_warmup_steps, num_training_steps or 0))


def plan_steps(args: Any, state: Any, loader: Any, accumulation: int, num_processes: int) -> None:
    """Fill ``state.max_steps``, ``steps_per_epoch`` and the intervals from the prepared train loader: optimizer
    steps, not batches (an epoch has ``ceil(batches / accumulation)``)."""
    try:
        state.steps_per_epoch = max(1, math.ceil(len(loader) / accumulation))
    except TypeError:
        state.steps_per_epoch = None
    if args.max_steps > 0:
        state.max_steps = args.max_steps
    elif state.steps_per_epoch is None:
        raise ConfigError("the train_dataset has no length, so num_train_epochs cannot be converted to steps; "
                          "set max_steps")
    else:
        state.max_steps = max(1, math.ceil(args.num_train_epochs * state.steps_per_epoch))
    spe = state.steps_per_epoch
    state.num_train_epochs = math.ceil(state.max_steps / spe) if spe else 0
    state.train_batch_size = args.per_device_train_batch_size * num_processes * accumulation
    state.logging_steps = args.interval("logging_steps", state.max_steps)
    state.eval_steps = args.interval("eval_steps", state.max_steps)
    state.save_steps = args.interval("save_steps", state.max_steps)
