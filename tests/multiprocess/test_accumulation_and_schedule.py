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


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradient of one batch, computed on a plain copy of the model (no DDP, no impel)."""
    import copy

    plain = copy.deepcopy(model)
    plain.zero_grad()
    nn.functional.mse_loss(plain(x), y).backward()
    return [p.grad.clone() for p in plain.parameters()]


def _no_sync_then_sync(own: bool):
    from impel import Accelerator

    acc = Accelerator(cpu=True)
    reference = make_mlp()
    model, loader = acc.prepare(make_mlp(), DataLoader(make_regression(16), batch_size=2))
    (x1, y1), (x2, y2) = list(loader)[:2]
    local = [_local_grads(reference, x, y) for x, y in ((x1, y1), (x2, y2))]
    with model.no_sync() if own else acc.no_sync(model):  # DDP's own switch on the prepared model, or impel's
        acc.backward(nn.functional.mse_loss(model(x1), y1))
    inside = [p.grad.clone() for p in model.parameters()]
    acc.backward(nn.functional.mse_loss(model(x2), y2))  # outside: reduces everything accumulated so far
    after = [p.grad.clone() for p in model.parameters()]
    return local, inside, after


@pytest.mark.parametrize("own", [False, True], ids=["accelerator.no_sync", "model.no_sync"])
def test_no_sync_keeps_gradients_local_until_the_next_synced_backward(own):
    (local0, inside0, after0), (local1, inside1, after1) = run_on_ranks(_no_sync_then_sync, 2, args=(own,))
    for rank_local, inside in ((local0, inside0), (local1, inside1)):
        for got, want in zip(inside, rank_local[0]):
            torch.testing.assert_close(got, want)  # each rank's own gradient, not reduced
    assert not all(torch.equal(a, b) for a, b in zip(inside0, inside1))  # the ranks' batches differ
    for a, b, l0a, l0b, l1a, l1b in zip(after0, after1, local0[0], local0[1], local1[0], local1[1]):
        assert torch.equal(a, b)
        # the mean over ranks of each rank's accumulated (local + local) gradient
        torch.testing.assert_close(a, ((l0a + l0b) + (l1a + l1b)) / 2)


def _accumulate_sync_each_batch():
    from impel import Accelerator, GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    reference, model = make_mlp(), make_mlp()
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0),  # lr 0: weights stay
                                     DataLoader(make_regression(16), batch_size=2))
    seen = []
    for i, (x, y) in enumerate(loader):
        if i == 4:
            break
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            local = [g / 2 for g in _local_grads(reference, x, y)]  # this micro-step's share of the group's mean
            seen.append((acc.sync_gradients, [p.grad.clone() for p in model.parameters()], local))
        opt.step()
        opt.zero_grad()  # a no-op inside a group: gradients accumulate until the boundary
    return seen


def test_sync_each_batch_reduces_every_micro_step_but_steps_on_boundaries():
    r0, r1 = run_on_ranks(_accumulate_sync_each_batch, 2)
    assert [s for s, _, _ in r0] == [s for s, _, _ in r1] == [False, True, False, True]
    accumulated: list[torch.Tensor] = []
    for (sync, g0, l0), (_, g1, l1) in zip(r0, r1):
        reduced = [(a + b) / 2 for a, b in zip(l0, l1)]  # averaged over ranks at this very micro-step
        accumulated = [a + r for a, r in zip(accumulated, reduced)] if accumulated else reduced
        for a, b, want in zip(g0, g1, accumulated):
            assert torch.equal(a, b)  # equal on both ranks inside the group too: reduced on every batch
            torch.testing.assert_close(a, want)
        if sync:
            accumulated = []  # the boundary's zero_grad starts the next group


def _lr_trace(accumulation: int, steps: int, split: bool, per_process: bool = True):
    from impel import Accelerator, DataLoaderConfiguration

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                      dataloader_config=DataLoaderConfiguration(split_batches=split),
                      step_scheduler_per_process=per_process)
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
def test_scheduler_steps_once_per_optimizer_step_when_asked(world, accumulation):
    """``step_scheduler_per_process=False`` : one scheduler step per optimizer step on any
    world size, none mid-group."""
    steps = 6
    lrs = run_on_ranks(_lr_trace, world, args=(accumulation, steps, False, False))[0]
    expected = [1.0 / (1 + (i + 1) // accumulation) for i in range(steps * accumulation)]
    assert lrs == pytest.approx(expected)


@pytest.mark.parametrize("split", [False, True])
def test_scheduler_steps_once_per_process_by_default(split):
    """The default, as Accelerate: 2 ranks step the scheduler twice per optimizer step (once with split_batches).
    Accelerate itself is compared in test_scheduler_matches_accelerate.py."""
    lrs = run_on_ranks(_lr_trace, 2, args=(1, 4, split))[0]
    per_step = 1 if split else 2
    assert lrs == pytest.approx([1.0 / (1 + per_step * (i + 1)) for i in range(4)])
