"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): ranks train independently, averaging parameters
every ``local_sgd_steps`` steps instead of all-reducing gradients every step.

Inside the ``with`` block the prepared model does not synchronise gradients (``accelerator.no_sync(model)``), so
each rank's optimizer steps on its own gradients; ``step()`` counts calls and, on every ``local_sgd_steps``-th,
replaces each parameter with its mean over the ranks. Leaving the block averages once more. On one process it
counts steps and does nothing else, as Accelerate's does. Optimizer states (Adam's moments) stay per rank.

Example::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from types import TracebackType

    from impel.accelerator.facade import Accelerator

_WHY_NOT = {"FSDP": "shards the parameters across the ranks", "DEEPSPEED": "hands the model to DeepSpeed's engine"}


class LocalSGD:
    """Average the model's parameters across ranks every ``local_sgd_steps`` calls of :meth:`step`.

    ``enabled=False`` (or a single process) keeps plain synchronous training: ``step()`` only counts.
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        distributed_type = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if not accelerator.strategy.whole_model:
            why = _WHY_NOT.get(distributed_type, "keeps no whole replica of the model on each rank")
            raise NotImplementedError(
                f"LocalSGD averages whole model replicas, but distributed_type={distributed_type!r} {why}; train with "
                "DDP (MULTI_GPU / MULTI_CPU) to use LocalSGD, or drop LocalSGD")
        if enabled and (isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int)
                        or local_sgd_steps < 1):
            raise ValueError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}) must be a positive int (parameters are "
                             "averaged every that many steps); pass e.g. 8, or enabled=False to turn LocalSGD off")
        self.enabled = bool(enabled) and accelerator.use_distributed
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync: contextlib.AbstractContextManager[object] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            # The Accelerator's own switch, not DDP's model.no_sync(): impel's prepared forward sets DDP's sync flag
            # from the accumulation state on every micro-step, which would override DDP's context.
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._no_sync is None:
            return
        try:
            if exc_type is None:  # averaging is collective: after an error on one rank it could hang the others
                self._average_parameters()
        finally:
            no_sync, self._no_sync = self._no_sync, None
            no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count one step; on every ``local_sgd_steps``-th, average the parameters across ranks."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                # In place, so that the optimizer, DDP's reducer and tied weights keep the same tensor.
                param.copy_(self.accelerator.reduce(param.detach(), reduction="mean"))
