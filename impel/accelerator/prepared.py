"""The record of what an Accelerator prepared and registered, in preparation order.

The Accelerator owns one :class:`Prepared` and appends to it in ``prepare`` / ``register_for_checkpointing``; the
checkpointer and the resilience logic receive the same record (never the Accelerator) and read it.
``accelerator._models`` / ``_optimizers`` / ``_schedulers`` / ``_dataloaders`` (names some libraries read on
Accelerate's Accelerator) are views of these lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from impel.runtime.loaders.prepared_loader import PreparedLoader
    from impel.runtime.ranks.process import ProcessState
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.optimizer import AcceleratedOptimizer, AcceleratedScheduler
    from impel.strategies.base import Strategy


@dataclass(eq=False)
class Prepared:
    """Prepared models (uncompiled, as the strategy wrapped them), optimizers, schedulers and dataloaders, and the
    objects registered for checkpointing."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[PreparedLoader] = field(default_factory=list)
    registered: list[Any] = field(default_factory=list)

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers inside the wrappers: the strategy steps them and the GradScaler keys its unscale
        bookkeeping by their identity (unscaling a wrapper would unscale twice: there and again in scaler.step)."""
        return [opt.optimizer for opt in self.optimizers]

    def optimizer_steps(self) -> list[int]:
        return [opt.steps_taken for opt in self.optimizers]

    def counts(self) -> dict[str, int]:
        """How many of each kind; a checkpoint records these and refuses to load into a different layout."""
        return {"models": len(self.models), "optimizers": len(self.optimizers), "schedulers": len(self.schedulers),
                "dataloaders": len(self.dataloaders), "registered objects": len(self.registered)}

    def forget(self, obj: object) -> None:
        """Drop one prepared object (e.g. a one-off evaluation loader) so it is no longer checkpointed."""
        for group in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            for i, item in enumerate(group):
                if item is obj:
                    del group[i]
                    return
        raise ValueError(f"{type(obj).__name__} object at {id(obj):#x} was not prepared by this Accelerator")

    def clear(self) -> None:
        """Forget every prepared object (``free_memory``); registered objects stay registered."""
        for group in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            group.clear()


@dataclass(frozen=True, eq=False)
class TrainingRun:
    """What ``save_state`` / ``load_state`` and the resilience logic act on, handed over by the Accelerator once it
    is built: the prepared record, the strategy, the accumulation state, this process and two resolved settings."""

    prepared: Prepared
    strategy: Strategy
    gradient_state: GradientState
    process: ProcessState
    distributed_type: str
    mixed_precision: str

    @property
    def device(self) -> torch.device:
        return self.process.device

    @property
    def process_index(self) -> int:
        return self.process.process_index

    @property
    def num_processes(self) -> int:
        return self.process.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.process.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.process.is_local_main_process

    @property
    def step(self) -> int:
        """Accelerate's ``accelerator.step``: micro-steps begun since the last one that ended a dataloader."""
        return self.gradient_state.step
