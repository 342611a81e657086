"""PEFT 0.21 LoRA in Accelerate's custom-loop recipe on impel's Accelerator, 2 CPU ranks: DDP and FSDP2 (frozen base,
trainable adapters) with accumulation train like one process at the same global batch; the adapter saved with
Accelerate's ``save_pretrained(..., state_dict=accelerator.get_state_dict(model))`` loads back equal in PEFT; the
plain ``save_pretrained(dir)`` of an FSDP2 model raises naming that form."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")

from impel.testing import run_on_ranks  # noqa: E402
from peft_helpers import both_strategies, lora_loop  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _diff(a, b):
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_lora_under_ddp_and_fsdp2_trains_like_one_process_and_saves_an_adapter_peft_loads(tmp_path):
    one = lora_loop("ddp", 4, str(tmp_path / "one"))
    ranks = run_on_ranks(both_strategies, 2, args=(str(tmp_path / "ranks"),), timeout=180)
    for strategy in ("ddp", "fsdp"):
        ours = ranks[0][strategy]
        assert ours["world"] == 2
        assert _diff(ours["trained"], one["trained"]) <= 1e-5, strategy
        assert ours["losses"] == pytest.approx(one["losses"], abs=1e-5), strategy
        assert _diff(ours["reloaded"], ours["trained"]) == 0.0, strategy
    assert one["plain"] == ranks[0]["ddp"]["plain"] == "saved"
    assert ranks[0]["fsdp"]["plain"].startswith("ConfigError: PeftModel.save_pretrained(...) under FSDP2 without "
                                                "state_dict=")
    assert "state_dict=accelerator.get_state_dict(model)" in ranks[1]["fsdp"]["plain"]
