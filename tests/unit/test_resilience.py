"""Non-finite losses (error / skip) and auto-resume's preconditions, in one process."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel import Accelerator, ConfigError, ProjectConfiguration


def _train(acc: Accelerator, nan_at: int | None, steps: int = 6):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(make_regression(48), batch_size=8), sched)
    snapshots = []
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        if i == nan_at:
            loss = loss * float("nan")
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        snapshots.append([p.detach().clone() for p in model.parameters()])
        if i + 1 == steps:
            break
    return opt, sched, snapshots


def test_default_ignores_and_costs_nothing():
    acc = Accelerator(cpu=True)
    assert acc._resilience is None
    _, _, snaps = _train(acc, nan_at=2)
    assert torch.isnan(snaps[2][0]).any()  # nothing checked: NaN reaches the weights, as in plain torch


def test_error_names_the_step():
    acc = Accelerator(cpu=True, nonfinite_loss="error")
    with pytest.raises(FloatingPointError, match="non-finite loss .* before optimizer step 3, seen on rank 0"):
        _train(acc, nan_at=2)


def test_skip_skips_the_step_and_the_scheduler():
    opt, sched, snaps = _train(Accelerator(cpu=True, nonfinite_loss="skip"), nan_at=2)
    assert all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))  # step 3 did not change the weights
    assert not any(torch.isnan(p).any() for p in snaps[-1])
    assert opt.steps_taken == 5 and sched.get_last_lr()[0] == pytest.approx(0.1 * 0.5 ** 5)


def test_bad_nonfinite_mode():
    with pytest.raises(ConfigError, match="nonfinite_loss='warn' is not allowed; use one of 'ignore', 'error', 'skip'"):
        Accelerator(cpu=True, nonfinite_loss="warn")


def test_auto_resume_needs_a_project_with_automatic_naming(tmp_path):
    with pytest.raises(ConfigError, match="auto_resume needs somewhere to find checkpoints"):
        Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path), automatic_resume=True))


def test_auto_resume_starts_fresh_then_resumes(tmp_path, capsys):
    def run(project, steps: int):
        from impel.runtime.ranks.process import ProcessState

        ProcessState._reset()
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            str(project), automatic_checkpoint_naming=True, automatic_resume=True))
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(48), batch_size=8, shuffle=True))
        for x, y in loader:
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if opt.steps_taken == steps:
                break
        acc.save_state()
        acc.end_training()
        return opt.steps_taken, [p.detach().clone() for p in model.parameters()]

    steps, at_two = run(tmp_path / "cut", 2)
    assert steps == 2 and "no complete checkpoint" in capsys.readouterr().out
    steps, resumed = run(tmp_path / "cut", 5)  # resumes at step 2 and continues to step 5 of the same epoch
    assert steps == 5 and "resumed from" in capsys.readouterr().out
    _, uninterrupted = run(tmp_path / "whole", 5)
    # the resumed run continued from step 2's weights, optimizer, RNG and data position: bit for bit the same run
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))
    assert not all(torch.equal(a, b) for a, b in zip(resumed, at_two))
