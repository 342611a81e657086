"""The step's hot path, counted: Python functions of impel entered per training step (deterministic, unlike time).

``benchmarks/overhead.py`` measures the time; this keeps its cause from growing back unnoticed. A step of a
prepared model and optimizer on one process enters six of impel's functions (the forward wrapper and its sync
check, ``backward`` and the strategy's, the optimizer's ``step`` and ``zero_grad``); a micro-step under
``accumulate()`` sixteen (the micro-step's own bookkeeping, the loss division, once per group the sync switch).
New per-step bookkeeping belongs at ``prepare()`` time, not here.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import impel
from impel import Accelerator

IMPEL_DIR = str(Path(impel.__file__).parent)


def _impel_calls_per_step(steps: int, accumulation: int) -> tuple[float, list[tuple[str, int]]]:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(steps)]
    calls = 0
    seen = []

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(IMPEL_DIR):
            calls += 1
            seen.append(frame.f_code.co_name)

    def one(x, y):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    def plain(x, y):
        acc.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()

    loop = one if accumulation > 1 else plain
    loop(*batches[0])  # warm: first-call work is not the step's
    sys.setprofile(count)
    try:
        for x, y in batches[1:]:
            loop(x, y)
    finally:
        sys.setprofile(None)
    return calls / (steps - 1), sorted(collections.Counter(seen).items())


def test_a_step_enters_six_of_impels_functions():
    per_step, seen = _impel_calls_per_step(9, 1)
    assert per_step <= 6, f"impel's functions entered in 8 steps: {seen}"


def test_a_micro_step_under_accumulate_enters_at_most_sixteen():
    per_step, seen = _impel_calls_per_step(9, 4)
    assert per_step <= 16, f"impel's functions entered in 8 micro-steps (2 groups of 4): {seen}"
