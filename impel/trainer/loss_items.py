"""What impel's own Trainer counts as a batch's loss items, for ``accelerator.item_windows``.

A token-level loss (2-D ``labels``, or ``shift_labels``) counts its target tokens as transformers' Trainer counts
``num_items_in_batch``; any other batch counts its samples (the first tensor's length), which for equal batches
gives every micro-batch the same weight, as before. Either way the window's gradient is the mean over every loss item
of the window on every rank: 2 ranks x 4 x accumulation 2 trains like one process x 16.

Example::

    for batch in accelerator.item_windows(loader, count=loss_items):
        ...
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from impel.runtime.item_windows import count_loss_items


def _samples(batch: Any) -> int:
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def loss_items(batch: Any) -> Any:
    """Target tokens for a token-level loss, else samples."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        if "shift_labels" in batch or (isinstance(labels, torch.Tensor) and labels.dim() > 1):
            return count_loss_items(dict(batch))
    return _samples(batch)
