"""Gradient sync on accumulation boundaries, and the scheduler's step count, on 2 ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _grads_per_micro_step(use_accumulate: bool):
    from impel import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt, loader = acc.prepare(make_mlp(), torch.optim.SGD(make_mlp().parameters(), lr=0.0),
                                     DataLoader(make_regression(16), batch_size=2))
    seen = []
    for i, (x, y) in enumerate(loader):
        if i == 4:
            break
        if use_accumulate:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                seen.append((acc.sync_gradients, [p.grad.clone() for p in model.parameters()]))
        else:
            acc.backward(nn.functional.mse_loss(model(x), y))
            seen.append((acc.sync_gradients, [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("use_accumulate", [True, False])
def test_gradients_reduce_only_on_boundaries(use_accumulate):
    r0, r1 = run_on_ranks(_grads_per_micro_step, 2, args=(use_accumulate,))
    assert [s for s, _ in r0] == [False, True, False, True]
    for (sync, g0), (_, g1) in zip(r0, r1):
        same = all(torch.equal(a, b) for a, b in zip(g0, g1))
        # non-boundary micro-steps keep each rank's local gradient; boundaries hold the all-reduced mean
        assert same is sync


def _lr_trace(accumulation: int, steps: int, split: bool):
    from impel import Accelerator, DataLoaderConfiguration

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                      dataloader_config=DataLoaderConfiguration(split_batches=split))
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loader = DataLoader(make_regression(400), batch_size=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    lrs = []
    for i, (x, y) in enumerate(loader):
        if i == steps * accumulation:
            break
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    return lrs


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_scheduler_steps_once_per_optimizer_step(world, accumulation):
    steps = 6
    lrs = run_on_ranks(_lr_trace, world, args=(accumulation, steps, False))[0]
    expected = [1.0 / (1 + (i + 1) // accumulation) for i in range(steps * accumulation)]
    assert lrs == pytest.approx(expected)
