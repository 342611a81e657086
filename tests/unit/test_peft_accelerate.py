"""PEFT 0.21 LoRA in Accelerate's custom-loop recipe (tiny GPT-2, frozen base + trainable adapters, accumulation 2) on
impel's Accelerator and on Accelerate's own, one process: the same losses and adapters, bitwise, for the
uninterrupted run and for a save_state / load_state resume into a fresh Accelerator, model and optimizer; the adapter
saved with Accelerate's ``save_pretrained(..., state_dict=accelerator.get_state_dict(model))`` loads back equal in
PEFT on both. (2 ranks and FSDP2 against one process: ``tests/multiprocess/test_peft_ranks.py``.)"""
from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("accelerate")

from peft_helpers import lora_loop  # noqa: E402


def _same(a, b):
    assert a.keys() == b.keys() and a
    return all(bool((a[k] == b[k]).all()) for k in a)


@pytest.mark.parametrize("resume_at", [None, 2], ids=["uninterrupted", "resumed"])
def test_lora_on_impel_equals_lora_on_accelerate(tmp_path, resume_at):
    theirs = lora_loop("ddp", 2, str(tmp_path / "accelerate"), resume_at=resume_at, library="accelerate")
    ours = lora_loop("ddp", 2, str(tmp_path / "impel"), resume_at=resume_at)
    assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 12
    assert _same(ours["trained"], theirs["trained"])
    assert _same(ours["reloaded"], ours["trained"]) and _same(theirs["reloaded"], theirs["trained"])
    assert ours["plain"] == theirs["plain"] == "saved"
