"""accelerator.item_windows: per-token losses exact under accumulation (one process; ranks in
tests/multiprocess/test_item_windows_ranks.py)."""
from __future__ import annotations

import pytest
import torch

from hf_trainer_helpers import custom_loop
from impel.config.run_config import ConfigError
from impel.runtime.step.item_windows import count_loss_items


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_four_micro_batches_of_four_equal_one_batch_of_sixteen():
    reference = custom_loop("impel", "plain", batch=16, accumulation=1)
    windows = custom_loop("impel", "windows", batch=4, accumulation=4)
    assert _max_diff(windows["weights"], reference["weights"]) <= 1e-6
    means = custom_loop("impel", "plain", batch=4, accumulation=4)  # averaging micro-batch means: not the same
    assert _max_diff(means["weights"], reference["weights"]) > 1e-4


def test_without_accumulation_it_changes_nothing():
    plain = custom_loop("impel", "plain", batch=8, accumulation=1)
    windows = custom_loop("impel", "windows", batch=8, accumulation=1)
    assert _max_diff(windows["weights"], plain["weights"]) <= 1e-7


def test_the_default_count_follows_transformers():
    labels = torch.tensor([[1, 2, -100], [4, -100, -100]])
    assert int(count_loss_items({"labels": labels})) == 1  # shifted: position 0 is never a target
    assert int(count_loss_items({"labels": torch.tensor([0, 1, -100])})) == 2  # 1-D: one item per sample
    assert int(count_loss_items({"labels": labels, "shift_labels": labels})) == 3
    with pytest.raises(ConfigError, match="pass count=lambda batch"):
        count_loss_items((torch.ones(2), torch.ones(2)))
