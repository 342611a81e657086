"""``impel.accelerator.local_sgd.LocalSGD`` trains like ``accelerate.local_sgd.LocalSGD`` on 2 CPU ranks over gloo.

The loop is Accelerate's ``examples/by_feature/local_sgd.py`` (prepared model, optimizer, dataloader and scheduler;
``with LocalSGD(...) as local_sgd:`` around the epoch; ``accumulate`` and ``local_sgd.step()`` on every batch),
run once under each framework. Besides equal parameters after every step, the ranks' replicas must differ between
averaging steps (gradients are not all-reduced inside the block) and agree right after one (``step()`` averaged).
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

TOLERANCE = 1e-6  # max |impel - Accelerate| over every parameter, after every step
MIN_DRIFT = 1e-4  # between averaging steps the two ranks' replicas must differ by more than this
EPOCHS, BATCH, SAMPLES = 2, 4, 48  # 6 batches per rank per epoch


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _train(framework: str, accumulation: int, local_sgd_steps: int, optim: str) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD
    else:
        from impel import Accelerator
        from impel.accelerator.local_sgd import LocalSGD
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = make_mlp(dim=6, hidden=16)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.02))
    loader = DataLoader(make_regression(SAMPLES, dim=6, seed=5), batch_size=BATCH)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    steps = []  # after each local_sgd.step(): (its count, whether the optimizer stepped, the parameters)
    enabled = []
    for _ in range(EPOCHS):
        model.train()
        with LocalSGD(accelerator=acc, model=model, local_sgd_steps=local_sgd_steps, enabled=True) as local_sgd:
            enabled.append(local_sgd.enabled)
            for x, y in loader:
                with acc.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    local_sgd.step()
                steps.append((local_sgd.num_steps, acc.sync_gradients, _flat(model)))
        steps.append(("exit", False, _flat(model)))  # leaving the block averages once more
    return {"steps": steps, "final": _flat(acc.unwrap_model(model)), "enabled": enabled}


@pytest.mark.parametrize(("accumulation", "local_sgd_steps", "optim"), [(1, 3, "sgd"), (2, 3, "adamw")])
def test_local_sgd_matches_accelerate(accumulation, local_sgd_steps, optim):
    args = (accumulation, local_sgd_steps, optim)
    ours = run_on_ranks(_train, 2, args=("impel", *args))
    theirs = run_on_ranks(_train, 2, args=("accelerate", *args), env=ACCELERATE_ENV)
    for rank in range(2):
        assert [s[:2] for s in ours[rank]["steps"]] == [s[:2] for s in theirs[rank]["steps"]]
        worst = max((a[2] - b[2]).abs().max().item() for a, b in zip(ours[rank]["steps"], theirs[rank]["steps"]))
        final = (ours[rank]["final"] - theirs[rank]["final"]).abs().max().item()
        print(f"rank {rank}: max |impel - accelerate| over {len(ours[rank]['steps'])} steps = {worst:.3g}, final "
              f"{final:.3g} (tolerance {TOLERANCE:g})")
        assert worst <= TOLERANCE and final <= TOLERANCE
    drifts, agreements = [], []
    stepped_since_average = False
    for (count, stepped, p0), (_, _, p1) in zip(ours[0]["steps"], ours[1]["steps"]):
        stepped_since_average = stepped_since_average or stepped
        gap = (p0 - p1).abs().max().item()
        if count == "exit" or count % local_sgd_steps == 0:
            agreements.append(gap)
            stepped_since_average = False
        elif stepped_since_average:
            drifts.append(gap)
    print(f"replicas between averages differ by >= {min(drifts):.3g} ({len(drifts)} steps); right after an average "
          f"by <= {max(agreements):.3g} ({len(agreements)} averages)")
    assert drifts and min(drifts) > MIN_DRIFT, "the ranks trained in lockstep: gradients were all-reduced"
    assert agreements and max(agreements) == 0, "step() did not average the parameters across the ranks"


def test_one_process_is_a_no_op_like_accelerate():
    ours = run_on_ranks(_train, 1, args=("impel", 1, 2, "sgd"))[0]
    theirs = run_on_ranks(_train, 1, args=("accelerate", 1, 2, "sgd"), env=ACCELERATE_ENV)[0]
    # impel runs one process as distributed_type NO, where LocalSGD is off; Accelerate under torchrun's variables
    # calls it MULTI_CPU with one process and averages over that one rank: the same numbers either way
    assert ours["enabled"] == [False] * EPOCHS
    assert [s[:2] for s in ours["steps"]] == [s[:2] for s in theirs["steps"]]
    final = (ours["final"] - theirs["final"]).abs().max().item()
    print(f"one process: max |impel - accelerate| = {final:.3g} (tolerance {TOLERANCE:g})")
    assert final <= TOLERANCE
