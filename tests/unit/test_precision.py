"""Mixed precision on CPU: bf16 autocast inside the prepared forward; fp16 with torch's CPU GradScaler."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from helpers import make_mlp, make_regression
from impel import Accelerator, AutocastKwargs, GradScalerKwargs
from impel.runtime.step.precision import make_precision

# bf16 keeps 8 significant bits (relative rounding error 2**-9 per value); through a small MLP the mse loss
# stays within 1% of the fp32 loss.
BF16_LOSS_RTOL = 1e-2


class Probe(nn.Module):
    """Records the dtype its matmul produces inside forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 16)
        self.out = nn.Linear(16, 1)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.lin.weight.T
        self.seen.append(h.dtype)
        return self.out(torch.tanh(h + self.lin.bias))


@pytest.mark.parametrize("mode,dtype", [("no", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_matmul_inside_the_prepared_forward_runs_in_the_autocast_dtype(mode, dtype):
    acc = Accelerator(cpu=True, mixed_precision=mode)
    model = acc.prepare(Probe())
    model(torch.randn(4, 6))
    assert model.seen == [dtype]
    assert acc.mixed_precision == mode


def test_autocast_stays_inside_the_forward():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(Probe())
    x = torch.randn(4, 6)
    model(x)
    assert (x @ x.T).dtype == torch.float32  # outside the prepared forward nothing is autocast
    with acc.autocast():
        assert (x @ x.T).dtype == torch.bfloat16


def test_autocast_kwargs_can_disable_autocast():
    acc = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = acc.prepare(Probe())
    model(torch.randn(4, 6))
    assert model.seen == [torch.float32]
    with acc.autocast(AutocastKwargs(enabled=True)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_bf16_loss_is_close_to_the_fp32_loss():
    x, y = make_regression(64).tensors
    reference = Probe()
    with torch.no_grad():
        fp32_loss = nn.functional.mse_loss(reference(x), y)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(copy.deepcopy(reference))
    with torch.no_grad():
        out = model(x)
        bf16_loss = nn.functional.mse_loss(out.float(), y)
    assert model.seen[-1] == torch.bfloat16
    assert float(bf16_loss) == pytest.approx(float(fp32_loss), rel=BF16_LOSS_RTOL)


def test_bf16_training_keeps_fp32_parameters_and_tracks_fp32_training():
    x, y = make_regression(64).tensors
    fp32 = make_mlp()
    fp32_opt = torch.optim.SGD(fp32.parameters(), lr=0.05)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = make_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for _ in range(5):
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(fp32(x), y).backward()
        fp32_opt.step()
        fp32_opt.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for a, b in zip(model.parameters(), fp32.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=2e-2, rtol=0)
    assert not acc.optimizer_step_was_skipped


def test_unknown_precision_mode_is_rejected():
    with pytest.raises(ValueError, match="'fp8'"):
        make_precision("fp8", torch.device("cpu"))


def test_scaler_kwargs_without_fp16_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="impel"):
        Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[GradScalerKwargs()])
    assert "GradScalerKwargs has no effect" in caplog.text


# --- fp16 on CPU: torch's CPU GradScaler --------------------------------------------------------------------------

LR = 0.1
SCALE = 1024.0


def fp16_setup(**kwargs):
    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=SCALE)],
                      **kwargs)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def test_fp16_on_cpu_uses_a_cpu_grad_scaler():
    acc, *_ = fp16_setup()
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    assert acc.scaler.is_enabled()
    assert acc.scaler.get_scale() == SCALE


def test_fp16_steps_with_unscaled_gradients_and_clip_sees_the_true_norm():
    acc, model, opt, sched = fp16_setup()
    for step in range(3):
        x, y = batch(step)
        acc.backward(nn.functional.mse_loss(model(x).float(), y))
        scale = acc.scaler.get_scale()
        scaled = [p.grad.clone() for p in model.parameters()]
        true_norm = torch.nn.utils.get_total_norm([g / scale for g in scaled])
        before = [p.detach().clone() for p in model.parameters()]
        lr = opt.param_groups[0]["lr"]
        norm = acc.clip_grad_norm_(model.parameters(), 1e9)
        torch.testing.assert_close(norm, true_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        assert not acc.optimizer_step_was_skipped
        for b, p, g in zip(before, model.parameters(), scaled):
            # exactly one unscale: p <- p - lr * g / scale
            torch.testing.assert_close(p.detach(), b - lr * g / scale)
    assert opt.steps_taken == 3
    assert sched.last_epoch == 3


def test_fp16_without_clipping_steps_with_unscaled_gradients():
    acc, model, opt, sched = fp16_setup()
    x, y = batch(0)
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    scaled = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for b, p, g in zip(before, model.parameters(), scaled):
        torch.testing.assert_close(p.detach(), b - LR * g / SCALE)


def test_unscale_gradients_then_clip_unscales_once():
    acc, model, opt, sched = fp16_setup()
    x, y = batch(0)
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    scaled = [p.grad.clone() for p in model.parameters()]
    acc.unscale_gradients()
    acc.unscale_gradients(opt)
    acc.clip_grad_norm_(model.parameters(), 1e9)
    for p, g in zip(model.parameters(), scaled):
        torch.testing.assert_close(p.grad, g / SCALE)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("clip", [False, True])
def test_fp16_step_with_a_non_finite_gradient_is_skipped(bad, clip):
    acc, model, opt, sched = fp16_setup()
    x, y = batch(0)
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    sched.step()
    opt.zero_grad()
    assert not acc.optimizer_step_was_skipped
    lr, epoch = opt.param_groups[0]["lr"], sched.last_epoch

    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    next(iter(model.parameters())).grad[0, 0] = bad
    before = [p.detach().clone() for p in model.parameters()]
    if clip:
        acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.optimizer_step_was_skipped and opt.step_was_skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert sched.last_epoch == epoch and opt.param_groups[0]["lr"] == lr
    assert opt.steps_taken == 1
    assert acc.scaler.get_scale() == SCALE / 2

    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    sched.step()
    opt.zero_grad()
    assert not acc.optimizer_step_was_skipped
    assert sched.last_epoch == epoch + 1
    assert opt.steps_taken == 2


def test_fp16_skipped_step_at_the_end_of_an_accumulation_group():
    acc, model, opt, sched = fp16_setup(gradient_accumulation_steps=2)
    x, y = batch(0)
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    sched.step()
    acc.backward(nn.functional.mse_loss(model(x).float(), y))
    next(iter(model.parameters())).grad[0, 0] = float("inf")
    opt.step()
    sched.step()
    opt.zero_grad()
    assert acc.sync_gradients and acc.optimizer_step_was_skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert sched.last_epoch == 0 and opt.steps_taken == 0


class NestedOut(nn.Module):
    """Returns what transformers models return: a mapping with tensors, a tuple, an int and None."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.lin(x)
        return {"logits": h, "pair": (h, x.long()), "count": 3, "nothing": None}


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_outputs_are_cast_to_fp32_as_accelerate(mode):
    acc = Accelerator(cpu=True, mixed_precision=mode)
    model = acc.prepare(NestedOut())
    out = model(torch.randn(4, 6))
    assert out["logits"].dtype == torch.float32 and out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64 and out["count"] == 3 and out["nothing"] is None
    out["logits"].sum().backward()  # the cast is part of the graph
    assert model.lin.weight.grad is not None


def test_cast_outputs_to_fp32_false_keeps_the_autocast_dtype():
    acc = Accelerator(cpu=True, mixed_precision="bf16", cast_outputs_to_fp32=False)
    model = acc.prepare(NestedOut())
    assert model(torch.randn(4, 6))["logits"].dtype == torch.bfloat16

