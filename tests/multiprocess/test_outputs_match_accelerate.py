"""Under mixed precision a prepared model returns fp32 floating outputs, as Accelerate 1.15 does: a GPT-2
ModelOutput's logits and loss equal Accelerate's exactly (same weights, same input, bf16 autocast on CPU). Each
framework runs in its own process (their process-wide states never meet)."""
from __future__ import annotations

import pytest
import torch

from impel.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _outputs(framework: str) -> dict:
    if framework == "accelerate":
        from accelerate import Accelerator
    else:
        from impel import Accelerator
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 8))
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    with torch.no_grad():
        out = model(ids, labels=ids)
    return {"type": type(out).__name__, "logits": out.logits, "loss": out.loss}


def test_bf16_logits_are_fp32_and_equal_to_accelerate():
    mine = run_on_ranks(_outputs, 1, args=("impel",))[0]
    ref = run_on_ranks(_outputs, 1, args=("accelerate",), env={"ACCELERATE_USE_CPU": "1"})[0]
    assert mine["type"] == ref["type"] == "CausalLMOutputWithCrossAttentions"
    assert mine["logits"].dtype == ref["logits"].dtype == torch.float32
    torch.testing.assert_close(mine["logits"], ref["logits"], rtol=0, atol=0)
    torch.testing.assert_close(mine["loss"], ref["loss"], rtol=0, atol=0)
