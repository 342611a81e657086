"""``accelerator.trigger_sync_in_backward`` on 2 CPU ranks (DDP): inside ``no_sync`` a backward in the block reduces
gradients across ranks, as Accelerate's does; without it each rank keeps its own."""
from __future__ import annotations

import pytest
import torch

from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _grads(trigger: bool) -> list[float]:
    from torch import nn

    from impel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(2, 1, bias=False))
    x = torch.full((1, 2), float(acc.process_index + 1))
    with acc.no_sync(model):
        first = model(x).sum()
        second = model(x).sum()
        if trigger:
            with acc.trigger_sync_in_backward(model):
                (first + second).backward()
        else:
            (first + second).backward()
    return acc.unwrap_model(model).weight.grad.flatten().tolist()


@pytest.mark.parametrize("trigger", [False, True])
def test_trigger_sync_in_backward_reduces_inside_no_sync(trigger):
    r0, r1 = run_on_ranks(_grads, 2, args=(trigger,), timeout=120)
    if trigger:
        assert r0 == r1 == [3.0, 3.0]  # the mean of rank 0's [2, 2] and rank 1's [4, 4]
    else:
        assert (r0, r1) == ([2.0, 2.0], [4.0, 4.0])
