"""impel's own Trainer: token-level losses exact under accumulation (accelerator.item_windows in its loop)."""
from __future__ import annotations

from hf_trainer_helpers import own_trainer


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_four_micro_batches_of_four_train_like_one_batch_of_sixteen(tmp_path):
    one = own_trainer(str(tmp_path / "one"), batch=16, accumulation=1)
    accumulated = own_trainer(str(tmp_path / "acc"), batch=4, accumulation=4)
    assert _max_diff(accumulated["weights"], one["weights"]) <= 1e-6
