"""PEFT 0.21 LoRA in Accelerate's custom-loop recipe on impel's Accelerator, 2 CPU ranks: DDP and FSDP2 (frozen base,
trainable adapters) with accumulation train like one process at the same global batch; a save_state / load_state
resume (a fresh Accelerator, model and optimizer) ends on the uninterrupted run; the adapter saved with Accelerate's
``save_pretrained(..., state_dict=accelerator.get_state_dict(model))`` loads back equal in PEFT; the plain
``save_pretrained(dir)`` of an FSDP2 model raises naming that form."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

from impel.testing import run_on_ranks  # noqa: E402
from peft_helpers import both_strategies, lora_loop  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _diff(a, b):
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_lora_under_ddp_and_fsdp2_trains_like_one_process_resumes_exactly_and_saves_an_adapter_peft_loads(tmp_path):
    """One process with the ranks' micro-batches (2 samples, accumulation 4): within 1e-6 (2e-7 measured). One
    process with micro-batches of 4 (accumulation 2) sums each micro-batch's rows in another order: 1.7e-6 apart
    after 3 AdamW steps, so that comparison allows 5e-6."""
    same = lora_loop("ddp", 2, str(tmp_path / "same"), accumulation=4)
    same_resumed = lora_loop("ddp", 2, str(tmp_path / "same-resumed"), accumulation=4, resume_at=4)
    wide = lora_loop("ddp", 4, str(tmp_path / "wide"))
    assert _diff(same_resumed["trained"], same["trained"]) == 0.0 and same_resumed["losses"] == same["losses"]
    pairs = [(a + b) / 2 for a, b in zip(same["losses"][0::2], same["losses"][1::2], strict=True)]
    ranks = run_on_ranks(both_strategies, 2, args=(str(tmp_path / "ranks"),), timeout=180)
    for strategy in ("ddp", "fsdp"):
        ours, resumed = ranks[0][strategy], ranks[0][f"{strategy} resumed"]
        assert ours["world"] == 2
        assert _diff(ours["trained"], same["trained"]) <= 1e-6, strategy
        assert ours["losses"] == pytest.approx(pairs, abs=1e-6), strategy
        assert _diff(ours["trained"], wide["trained"]) <= 5e-6, strategy
        assert ours["losses"] == pytest.approx(wide["losses"], abs=5e-6), strategy
        assert _diff(resumed["trained"], ours["trained"]) == 0.0 and resumed["losses"] == ours["losses"], strategy
        assert _diff(ours["reloaded"], ours["trained"]) == 0.0, strategy
    assert same["plain"] == ranks[0]["ddp"]["plain"] == "saved"
    assert ranks[0]["fsdp"]["plain"].startswith("ConfigError: PeftModel.save_pretrained(...) under FSDP2 without "
                                                "state_dict=")
    assert "state_dict=accelerator.get_state_dict(model)" in ranks[1]["fsdp"]["plain"]
