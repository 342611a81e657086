"""A NaN loss on one rank: every rank skips (or stops at) the same step, so replicas never diverge."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel.testing import RankFailed, run_on_ranks

pytestmark = pytest.mark.multiprocess


def _train(mode: str) -> list[torch.Tensor]:
    from impel import Accelerator

    acc = Accelerator(cpu=True, nonfinite_loss=mode)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(make_regression(64), batch_size=4))
    before_nan = None
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        if i == 3 and acc.process_index == 0:
            loss = loss * float("inf")
            before_nan = [p.detach().clone() for p in model.parameters()]
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if i == 3:
            after = [p.detach().clone() for p in model.parameters()]
        if i == 5:
            break
    if before_nan is not None:
        assert all(torch.equal(a, b) for a, b in zip(before_nan, after)), "the bad step was not skipped"
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()] + [torch.tensor(opt.steps_taken)]


def test_skip_on_one_rank_skips_on_all():
    ranks = run_on_ranks(_train, 2, args=("skip",), timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1]))
    assert int(ranks[0][-1]) == 5  # 6 batches, one step skipped


def test_error_on_one_rank_stops_every_rank():
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_train, 2, args=("error",), timeout=120)
    assert "before optimizer step 4" in str(err.value)
