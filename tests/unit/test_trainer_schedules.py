"""The learning-rate schedules equal transformers' get_*_schedule_with_warmup at every step."""
from __future__ import annotations

import io

import pytest
import torch
from transformers import (
    get_constant_schedule,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from impel.config.run_config import ConfigError
from impel.trainer.schedules import get_scheduler

REFERENCE = {
    "linear": lambda opt, w, t: get_linear_schedule_with_warmup(opt, w, t),
    "cosine": lambda opt, w, t: get_cosine_schedule_with_warmup(opt, w, t),
    "constant": lambda opt, w, t: get_constant_schedule(opt),
    "constant_with_warmup": lambda opt, w, t: get_constant_schedule_with_warmup(opt, w),
}


def _lrs(make, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (10, 10), (4, 37)])
def test_schedule_matches_transformers(name, warmup, total):
    ours = _lrs(lambda opt: get_scheduler(name, opt, warmup, total), total + 3)
    theirs = _lrs(lambda opt: REFERENCE[name](opt, warmup, total), total + 3)
    assert ours == pytest.approx(theirs, abs=1e-12)


def test_scheduler_state_loads_without_pickled_code():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = get_scheduler("cosine", opt, 2, 20)
    for _ in range(5):
        opt.step()
        sched.step()
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = get_scheduler("cosine", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 2, 20)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == sched.get_last_lr()


def test_bad_schedule_raises():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="did you mean|use one of"):
        get_scheduler("polynomial", opt, 0, 10)
    with pytest.raises(ConfigError, match="needs num_training_steps"):
        get_scheduler("linear", opt, 0, None)
