"""impel's own Trainer on 2 CPU ranks: token-level losses exact across ranks and accumulation."""
from __future__ import annotations

import pytest

from hf_trainer_helpers import own_trainer
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_ranks_by_4_with_accumulation_2_train_like_one_process_of_16(tmp_path):
    one = own_trainer(str(tmp_path / "one"), batch=16, accumulation=1)
    for result in run_on_ranks(own_trainer, 2, args=(str(tmp_path / "ranks"), 4, 2), timeout=150):
        assert result["processes"] == 2
        assert _max_diff(result["weights"], one["weights"]) <= 1e-6
