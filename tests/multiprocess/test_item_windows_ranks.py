"""Token-level losses on 2 CPU ranks: impel's item_windows, and Accelerate's documented recipe run unchanged on
impel with Accelerate's numbers; both equal one process on the whole batch."""
from __future__ import annotations

import pytest

from hf_trainer_helpers import custom_loop
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_ranks_by_4_with_accumulation_2_equal_one_process_of_16():
    reference = custom_loop("impel", "plain", batch=16, accumulation=1)
    for result in run_on_ranks(custom_loop, 2, args=("impel", "windows", 4, 2), timeout=120):
        assert result["processes"] == 2
        assert _max_diff(result["weights"], reference["weights"]) <= 1e-6


def test_accelerates_recipe_gives_accelerates_numbers_on_impel():
    reference = custom_loop("impel", "plain", batch=16, accumulation=1)
    accelerate = run_on_ranks(custom_loop, 2, args=("accelerate", "recipe", 4, 2), env=ACCELERATE_ENV,
                              timeout=120)[0]
    impel = run_on_ranks(custom_loop, 2, args=("impel", "recipe", 4, 2), timeout=120)[0]
    assert accelerate["processes"] == impel["processes"] == 2
    assert _max_diff(impel["weights"], accelerate["weights"]) <= 1e-6
    assert impel["losses"] == pytest.approx(accelerate["losses"], abs=1e-6)
    assert _max_diff(impel["weights"], reference["weights"]) <= 1e-6
