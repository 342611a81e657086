"""Accelerate's numbers by default: the last, short accumulation group of an epoch divides the loss by the nominal
``gradient_accumulation_steps``, as Accelerate 1.15 does (compared with Accelerate itself on 2 CPU ranks, 26 batches
per rank, accumulation 4: groups of 4 and a last group of 2); ``short_group_divisor="actual"`` is impel's exact
mean, one argument away."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")
ACCELERATE_ENV = {"ACCELERATE_USE_CPU": "1"}  # else Accelerate on a CPU box under torchrun trains unsynchronised


def _train(framework: str, divisor: str | None) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin
    else:
        from impel import Accelerator, GradientAccumulationPlugin
    extra = {} if divisor is None else {"short_group_divisor": divisor}
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, **extra))
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(make_regression(n=2 * 26 * 3), batch_size=3)  # 26 batches per rank
    model, opt, loader = acc.prepare(model, opt, loader)
    norms = []
    for _ in range(2):  # two epochs: the short group comes twice, and the next epoch starts a fresh group
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 100.0)))
                opt.step()
                opt.zero_grad()
    return {"norms": norms, "params": [p.detach().clone() for p in acc.unwrap_model(model).parameters()]}


def test_the_short_last_group_divides_as_accelerate_and_actual_is_one_argument_away():
    theirs = run_on_ranks(_train, 2, args=("accelerate", None), env=ACCELERATE_ENV, timeout=300)
    ours = run_on_ranks(_train, 2, args=("impel", None), timeout=300)
    exact = run_on_ranks(_train, 2, args=("impel", "actual"), timeout=300)
    for mine, ref, mean in zip(ours, theirs, exact):
        assert len(mine["norms"]) == len(ref["norms"]) == 14  # 6 full groups + 1 short, per epoch
        assert mine["norms"] == pytest.approx(ref["norms"], abs=1e-6)
        for a, b in zip(mine["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        # the exact mean doubles the short group's gradient (2 of 4 batches): its norm, and the end, differ
        assert mean["norms"][6] == pytest.approx(2 * ref["norms"][6], rel=1e-5)
        assert max(float((a - b).abs().max()) for a, b in zip(mean["params"], ref["params"])) > 1e-4
