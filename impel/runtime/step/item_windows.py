"""``accelerator.item_windows(dataloader)``: token-level (per-item) losses exact under accumulation and ranks.

A loop that accumulates per-micro-batch *means* weighs a short sequence's tokens more than a long one's: the mean of
4 micro-batch means is not the mean over the 4 micro-batches' tokens, nor is the mean over ranks. This iterator reads
each accumulation window (``gradient_accumulation_steps`` batches; the epoch's last window holds what remains)
ahead, counts each batch's loss items (``count(batch)``; by default the labels that are not -100, shifted by one for
a causal LM's 2-D labels, as transformers' Trainer counts ``num_items_in_batch``), sums the window's count over the
ranks (one all-reduce per window, no host sync) and yields the batches unchanged. While it yields a batch,
``accelerator.backward(loss)`` multiplies the batch's mean loss by ``items in the batch x processes / items in the
window on all ranks`` instead of dividing it by the window length, so the optimizer step sees the gradient of the
mean over every loss item of the window on every rank: 2 ranks x 4 x accumulation 2 equals one process x 16.
The windows also decide the syncs (the last window of an epoch is as long as what remains).

Example::

    for batch in accelerator.item_windows(train_dataloader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss            # the mean over this batch's loss tokens, as models return it
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from impel.config.run_config import ConfigError
from impel.runtime.step.accumulation import GradientState

IGNORE_INDEX = -100


def count_loss_items(batch: object) -> torch.Tensor:
    """The default ``count``: ``shift_labels`` != -100, else 2-D+ ``labels[..., 1:]`` != -100 (a causal LM's shifted
    targets), else 1-D ``labels`` != -100 (one item per sample)."""
    if not isinstance(batch, dict) or ("labels" not in batch and "shift_labels" not in batch):
        raise ConfigError("item_windows() counts batch['labels'] (or batch['shift_labels']) by default, and this "
                          f"batch is a {type(batch).__name__} without them: pass count=lambda batch: <the number "
                          "of loss items in batch>")
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    else:
        labels = batch["labels"]
        labels = labels[..., 1:] if labels.dim() > 1 else labels
    return (labels != IGNORE_INDEX).sum()


class ItemWindows:
    """Iterate ``dataloader`` window by window; see the module docstring. Built by ``accelerator.item_windows``."""

    def __init__(self, dataloader: Any, state: GradientState, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 processes: int, device: torch.device, count: Callable[[Any], Any] | None = None) -> None:
        if count is not None and not callable(count):
            raise ConfigError(f"item_windows(count={count!r}) must be a function of a batch returning its number "
                              "of loss items (an int or a tensor)")
        self.dataloader = dataloader
        self.state = state
        self.reduce_sum = reduce_sum
        self.processes = processes
        self.device = device
        self.count = count or count_loss_items

    def __len__(self) -> int:
        return len(self.dataloader)

    def _items(self, batch: object) -> torch.Tensor:
        return torch.as_tensor(self.count(batch), device=self.device).to(torch.float64)

    def __iter__(self) -> Iterator[Any]:
        if self.state.micro_in_group:
            raise ConfigError(f"item_windows() started {self.state.micro_in_group} micro-step(s) into an "
                              "accumulation window: start it at a window boundary (after an optimizer step)")
        batches = iter(self.dataloader)
        try:
            while window := list(itertools.islice(batches, self.state.num_steps)):
                counts = [self._items(batch) for batch in window]
                total = self.reduce_sum(torch.stack(counts).sum())
                for batch, items in zip(window, counts):
                    self.state.set_item_window(len(window), items * self.processes / total)
                    yield batch
        finally:
            self.state.set_item_window(None)
