"""A prepared scheduler steps as Accelerate 1.15's does, compared with Accelerate itself on 1 and 2 CPU ranks.

Accelerate scripts (its examples, transformers' ``*_no_trainer.py``) size their schedules from the unprepared
loader and rely on the scheduler stepping ``num_processes`` times per optimizer step; impel matches the learning
rate trace exactly, including micro-steps of ``accumulate()``, ``split_batches`` and OneCycleLR's end guard.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
accelerate = pytest.importorskip("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised


def _trace(framework: str, schedule: str, accumulation: int, split: bool, batches: int) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator, DataLoaderConfiguration
    else:
        from impel import Accelerator, DataLoaderConfiguration
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                      dataloader_config=DataLoaderConfiguration(split_batches=split))
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_regression(batches * 4), batch_size=4)
    total = len(loader) // accumulation  # sized from the unprepared loader, as run_clm_no_trainer does
    if schedule == "linear":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    lrs = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    inner = sched.scheduler
    return {"lrs": lrs, "last_epoch": inner.last_epoch, "step_count": inner._step_count,
            "params": [p.detach().clone() for p in acc.unwrap_model(model).parameters()]}


@pytest.mark.parametrize(("world", "schedule", "accumulation", "split"), [
    (2, "linear", 1, False), (2, "linear", 2, False), (2, "linear", 1, True), (1, "linear", 3, False),
    (2, "onecycle", 2, False)])
def test_learning_rate_trace_matches_accelerate(world, schedule, accumulation, split):
    batches = 24 if split else 12 * world  # split_batches: each global batch is cut across the ranks
    ours = run_on_ranks(_trace, world, args=("impel", schedule, accumulation, split, batches))
    theirs = run_on_ranks(_trace, world, args=("accelerate", schedule, accumulation, split, batches),
                          env=ACCELERATE_ENV)
    for mine, ref in zip(ours, theirs):
        assert mine["lrs"] == pytest.approx(ref["lrs"], abs=1e-12)
        assert (mine["last_epoch"], mine["step_count"]) == (ref["last_epoch"], ref["step_count"])
        for a, b in zip(mine["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
