"""A run configured by Accelerate's environment variables under plain torchrun (2 CPU ranks, no ``impel launch``)
trains with the same numbers as the same settings given in code."""
from __future__ import annotations

import pytest
import torch

from helpers import make_mlp, make_regression
from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess


def _train(in_code: bool):
    from torch.utils.data import DataLoader

    from impel import Accelerator

    acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4) if in_code else Accelerator()
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(make_regression(n=72), batch_size=3)  # 12 batches per rank: 3 groups of 4
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            steps += acc.sync_gradients
            opt.step()
            opt.zero_grad()
    params = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    return acc.mixed_precision, acc.gradient_accumulation_steps, steps, params


def test_environment_configured_run_trains_like_the_same_settings_in_code(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    from_env = run_on_ranks(_train, 2, args=(False,), timeout=240)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    from_code = run_on_ranks(_train, 2, args=(True,), timeout=240)
    plain = run_on_ranks(_train, 2, args=(False,), timeout=240)  # no variables: fp32, no accumulation
    for (mp, steps_per, optimizer_steps, params), (mp_c, steps_c, opt_c, params_c) in zip(from_env, from_code):
        assert (mp, steps_per, optimizer_steps) == (mp_c, steps_c, opt_c) == ("bf16", 4, 3)
        for name in params:
            assert torch.equal(params[name], params_c[name]), name
    assert plain[0][:3] == ("no", 1, 12)
    assert any(not torch.equal(plain[0][3][k], from_env[0][3][k]) for k in plain[0][3])
