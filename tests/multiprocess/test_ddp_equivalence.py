"""DDP on 2 CPU ranks ends with the same parameters as one process on the global batch."""
from __future__ import annotations

import pytest
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_optimizer, make_regression, max_abs_diff, reference_train
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _train(per_rank_batch: int, steps: int, accumulation: int, optimizer: str, use_accumulate: bool):
    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = make_mlp()
    opt = make_optimizer(model, optimizer, 0.05 if optimizer == "sgd" else 1e-2)
    loader = DataLoader(make_regression(), batch_size=per_rank_batch, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    micro = 0
    for x, y in loader:
        if micro == steps * accumulation:
            break
        ctx = acc.accumulate(model) if use_accumulate else _null()
        with ctx:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        micro += 1
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ddp_matches_single_process_global_batch(optimizer):
    ref = reference_train(make_mlp(), make_regression(), batch_size=8, steps=10,
                          lr=0.05 if optimizer == "sgd" else 1e-2, optimizer=optimizer)
    results = run_on_ranks(_train, 2, args=(4, 10, 1, optimizer, False))
    for r in results:
        assert max_abs_diff(r, ref) <= 1e-6
    assert max_abs_diff(results[0], results[1]) == 0.0


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("use_accumulate", [True, False])
def test_accumulation_matches_one_big_batch(world, use_accumulate):
    # 4 micro-steps of a global batch of 2 (1 rank x 2, or 2 ranks x 1) = one step of batch 8, 5 times over
    ref = reference_train(make_mlp(), make_regression(), batch_size=8, steps=5)
    results = run_on_ranks(_train, world, args=(2 // world, 5, 4, "sgd", use_accumulate))
    for r in results:
        assert max_abs_diff(r, ref) <= 1e-6
