"""One GPU: the memory estimate against ``torch.cuda`` allocations, bf16 autocast, CUDA RNG in checkpoints, FSDP2
over nccl against plain training."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from impel.testing import run_on_ranks

pytestmark = pytest.mark.gpu
SPEC = "GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256)"


def test_the_estimate_matches_cuda_allocations():
    """After the first AdamW step one process holds parameters, gradients and two moments (16 B/param in fp32):
    torch.cuda.memory_allocated must agree with the DDP row of the estimate within 10%, and the step's peak must
    lie between those states and the estimate's total with activations."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from impel import Accelerator
    from impel.commands.planning.estimate import Setup, estimate_all
    from impel.commands.planning.model_spec import build_meta_model, model_facts

    batch, seq = 4, 128
    acc = Accelerator()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 8192, (batch, seq), device=acc.device)
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    est = {e.strategy: e for e in estimate_all(model_facts(*build_meta_model(SPEC)),
                                               Setup(world=1, batch_size=batch, seq_len=seq))}["DDP"]
    states = est.params + est.grads + est.optimizer
    assert abs(held - states) <= 0.10 * states, f"held {held} vs estimated states {states}"
    assert states * 0.9 <= peak <= est.device_total * 1.5, f"peak {peak} vs estimate {est.device_total}"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1))


def _batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(64, 32, generator=g)
        out.append((x.to(device), x.sum(1, keepdim=True).sin().to(device)))
    return out


def _train(acc, model, opt, batches) -> float:
    loss = torch.tensor(0.0)
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return loss.item()


def test_bf16_autocast_computes_in_bf16_and_trains_near_fp32():
    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    losses = {}
    for mp in ("no", "bf16"):
        ProcessState._reset()
        acc = Accelerator(mixed_precision=mp)
        model = _mlp()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        batches = _batches(30, acc.device)
        with acc.autocast():
            out_dtype = model(batches[0][0]).dtype
        assert out_dtype == (torch.bfloat16 if mp == "bf16" else torch.float32)
        assert acc.precision_report().compute == (torch.bfloat16 if mp == "bf16" else torch.float32)
        losses[mp] = _train(acc, model, opt, batches)
    assert abs(losses["bf16"] - losses["no"]) <= 0.05 * abs(losses["no"]) + 1e-3, losses


def test_save_and_load_state_restore_the_cuda_rng(tmp_path):
    """Dropout draws from the CUDA generator: a resumed run continues bit-identically only if its state came back."""
    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    def run(resume: bool) -> dict[str, torch.Tensor]:
        ProcessState._reset()
        acc = Accelerator()
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        batches = _batches(6, acc.device)
        if resume:
            acc.load_state(str(tmp_path / "ckpt"))
            _train(acc, model, opt, batches[3:])
        else:
            _train(acc, model, opt, batches[:3])
            acc.save_state(str(tmp_path / "ckpt"))
            torch.cuda.manual_seed(1234)  # the resumed run must not depend on what happens after the save
            _train(acc, model, opt, batches[3:])
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    straight = run(resume=False)
    resumed = run(resume=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _fsdp_or_plain(steps: int) -> dict[str, torch.Tensor]:
    from impel import Accelerator

    acc = Accelerator()
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    _train(acc, model, opt, _batches(steps, acc.device))
    state = acc.get_state_dict(model)
    acc.end_training()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


@pytest.mark.timeout(2 * 300 + 60)  # two jobs of 300 s: a hang is reported by run_on_ranks
def test_fsdp2_over_nccl_on_one_gpu_matches_plain_training():
    fsdp = run_on_ranks(_fsdp_or_plain, 1, args=(10,), timeout=300,
                        env={"IMPEL_CONFIG": json.dumps({"distributed_type": "FSDP"})})[0]
    plain = run_on_ranks(_fsdp_or_plain, 1, args=(10,), timeout=300)[0]
    worst = max((fsdp[k] - plain[k]).abs().max().item() for k in plain)
    assert worst <= 1e-5, worst
