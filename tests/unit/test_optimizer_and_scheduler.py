"""The prepared optimizer and scheduler: no-ops mid-group, one scheduler step per real optimizer step, clipping."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel import Accelerator, GradientAccumulationPlugin

LR = 0.1


def setup(steps: int = 1, n: int = 40, batch_size: int = 4, scheduler=None, **kwargs):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=steps if "gradient_accumulation_plugin" not in kwargs
                      else None, **kwargs)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = (scheduler or (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)))(opt)
    loader = DataLoader(make_regression(n), batch_size=batch_size)
    return (acc, *acc.prepare(model, opt, loader, sched))


def run_epoch(acc, model, opt, loader, sched):
    calls = 0
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        calls += 1
    return calls


@pytest.mark.parametrize("steps,n,expected_optimizer_steps", [(1, 40, 10), (4, 40, 3), (3, 36, 3), (5, 40, 2),
                                                              (20, 40, 1)])
def test_scheduler_steps_once_per_real_optimizer_step(steps, n, expected_optimizer_steps):
    acc, model, opt, loader, sched = setup(steps, n)
    run_epoch(acc, model, opt, loader, sched)
    assert opt.steps_taken == expected_optimizer_steps
    ref_opt = torch.optim.SGD(make_mlp().parameters(), lr=LR)
    ref = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.9)
    for _ in range(expected_optimizer_steps):
        ref_opt.step()
        ref.step()
    assert sched.get_last_lr() == pytest.approx(ref.get_last_lr())
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.9 ** expected_optimizer_steps)
    assert sched.last_epoch == expected_optimizer_steps


def test_scheduler_with_a_warmup_lambda_matches_the_reference():
    warm = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))  # noqa: E731
    acc, model, opt, loader, sched = setup(2, 40, scheduler=warm)
    lrs = []
    for x, y in loader:
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    # after micro-step i (0-based) the scheduler has stepped (i + 1) // 2 times
    expected = [LR * min(1.0, ((i + 1) // 2 + 1) / 3) for i in range(10)]
    assert lrs == pytest.approx(expected)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_scheduler_steps_every_call_when_not_tied_to_the_optimizer():
    acc, model, opt, loader, sched = setup(4, 40, step_scheduler_with_optimizer=False)
    run_epoch(acc, model, opt, loader, sched)
    assert opt.steps_taken == 3
    assert sched.last_epoch == 10


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_adjust_scheduler_false_warns_and_changes_nothing_as_in_accelerate():
    with pytest.warns(UserWarning, match="adjust_scheduler=False"):
        plugin = GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False)
    acc, model, opt, loader, sched = setup(gradient_accumulation_plugin=plugin)
    run_epoch(acc, model, opt, loader, sched)
    assert opt.steps_taken == 3
    assert sched.last_epoch == 3


def test_scheduler_steps_every_call_without_step_with_optimizer():
    acc, model, opt, loader, sched = setup(steps=4, step_scheduler_with_optimizer=False)
    run_epoch(acc, model, opt, loader, sched)
    assert opt.steps_taken == 3
    assert sched.last_epoch == 10


def test_scheduler_prepared_after_the_optimizer_follows_it():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert sched.optimizers == [opt]
    for _ in range(4):
        acc.backward(model(torch.randn(2, 6)).sum())
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.steps_taken == 2
    assert sched.get_last_lr() == [pytest.approx(LR * 0.25)]


def test_optimizer_step_and_zero_grad_are_no_ops_mid_group():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    data = make_regression(9).tensors
    reference = copy.deepcopy(acc.unwrap_model(model, keep_fp32_wrapper=True))
    for p in reference.parameters():
        p.grad = None
    start = [p.detach().clone() for p in model.parameters()]
    expected_grads = None
    for i in range(3):
        x, y = data[0][3 * i:3 * i + 3], data[1][3 * i:3 * i + 3]
        acc.backward(nn.functional.mse_loss(model(x), y))
        # what plain accumulation of loss / 3 gives
        (nn.functional.mse_loss(type(reference).forward(reference, x), y) / 3).backward()
        expected_grads = [p.grad.clone() for p in reference.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e)
        opt.step()
        opt.zero_grad()
        if i < 2:
            assert not acc.sync_gradients
            assert all(torch.equal(s, p) for s, p in zip(start, model.parameters()))  # no step
            assert all(p.grad is not None for p in model.parameters())  # no zero_grad
        else:
            assert acc.sync_gradients
            for s, p, g in zip(start, model.parameters(), expected_grads):
                torch.testing.assert_close(p.detach(), s - LR * g)
            assert all(p.grad is None for p in model.parameters())
    assert opt.steps_taken == 1


def test_optimizer_reads_through_to_the_wrapped_one():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    raw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, raw)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is raw.param_groups
    assert opt.defaults is raw.defaults
    acc.backward(model(torch.randn(2, 6)).sum())
    opt.step()
    assert opt.state is raw.state and len(raw.state) == len(list(model.parameters()))
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == 1e-3
    opt.param_groups[0]["lr"] = 5e-4
    assert raw.param_groups[0]["lr"] == 5e-4
    opt.load_state_dict(state)
    assert raw.param_groups[0]["lr"] == 1e-3


# --- clipping -----------------------------------------------------------------------------------------------------

def grads_after_backward(acc, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    acc.backward(nn.functional.mse_loss(model(x), y) * 10)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm,norm_type", [(0.5, 2.0), (1e6, 2.0), (0.1, 1.0), (0.05, float("inf"))])
def test_clip_grad_norm_matches_torch(max_norm, norm_type):
    acc = Accelerator(cpu=True)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    grads = grads_after_backward(acc, model)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for t, g in zip(twins, grads):
        t.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(twins, max_norm, norm_type=norm_type)
    norm = acc.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for p, t in zip(model.parameters(), twins):
        torch.testing.assert_close(p.grad, t.grad)
    if max_norm < float(expected):
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        assert float(clipped) == pytest.approx(max_norm, rel=1e-4)


def test_clip_grad_norm_mid_group_returns_none_and_leaves_gradients():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    grads = grads_after_backward(acc, model)
    assert acc.clip_grad_norm_(model.parameters(), 1e-3) is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    grads_after_backward(acc, model, seed=1)
    assert acc.clip_grad_norm_(model.parameters(), 1e-3) is not None


def test_clip_grad_value():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    grads = grads_after_backward(acc, model)
    acc.clip_grad_value_(model.parameters(), 0.01)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g.clamp(-0.01, 0.01))
