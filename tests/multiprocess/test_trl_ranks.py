"""TRL 1.16's trainers on 2 CPU ranks through ``impel.trainer.on_impel``: the same weights, losses and rewards as TRL
on Accelerate under the same launch (``ACCELERATE_USE_CPU=1``), each resumed under DDP from a mid-run checkpoint
to the uninterrupted run, and under impel's FSDP2 a LoRA run (adapter-only
checkpoints), a DPO run (its reference model sharded by TRL with the plugin's policies) and a DPO run with
``sync_ref_model`` (the policy mixed into that reference model) train like one process at the same global batch and
resume from a mid-run checkpoint exactly."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from impel.testing import run_on_ranks  # noqa: E402
from trl_helpers import KINDS, max_diff, run_kinds, run_trl  # noqa: E402

pytestmark = pytest.mark.multiprocess

# fp32 (TRL's configs default to bf16, which FSDP2 applies to the parameters, autocast on one process to the matmuls)
FSDP = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}, "bf16": False}
FSDP_KINDS = ("sft_lora", "dpo", "dpo_sync")


def test_trl_trainers_on_two_ranks_equal_trl_on_accelerate(tmp_path):
    theirs = run_on_ranks(run_kinds, 2, args=(KINDS, "accelerate", str(tmp_path / "accelerate"), {}),
                          env={"ACCELERATE_USE_CPU": "1"}, timeout=240)
    ours = run_on_ranks(run_kinds, 2, args=(KINDS, "impel", str(tmp_path / "impel"), {}, KINDS), timeout=240)
    assert theirs[0]["world"] == ours[0]["world"] == 2
    for kind in KINDS:
        assert ours[0][kind]["accelerator"] == "impel.accelerator.facade"
        assert max_diff(ours[1][kind]["weights"], ours[0][kind]["weights"]) == 0.0, kind  # one model
        assert max_diff(ours[0][kind]["weights"], theirs[0][kind]["weights"]) <= 1e-6, kind
        assert ours[0][kind]["loss"] == pytest.approx(theirs[0][kind]["loss"], abs=1e-6), kind
        assert ours[0][kind]["reward"] == pytest.approx(theirs[0][kind]["reward"], abs=1e-6), kind
        # resumed from checkpoint-2 under DDP: the uninterrupted run's weights, losses and rewards, on every rank
        resumed = [rank[f"{kind} resumed"] for rank in ours]
        assert ours[0][kind]["checkpoints"] == ["checkpoint-2", "checkpoint-4"] and resumed[0]["step"] == 4, kind
        assert max(max_diff(r["weights"], ours[0][kind]["weights"]) for r in resumed) == 0.0, kind
        assert (resumed[0]["loss"], resumed[0]["reward"]) == (ours[0][kind]["loss"], ours[0][kind]["reward"]), kind


def _fsdp_runs(output_dir: str) -> dict[str, dict]:
    results = {}
    for kind in FSDP_KINDS:
        run = os.path.join(output_dir, kind)
        results[kind] = run_trl(kind, "impel", run, save_strategy="steps", save_steps=2, **FSDP)
        results[f"{kind} resumed"] = run_trl(kind, "impel", f"{run}-resumed",
                                             resume=os.path.join(run, "checkpoint-2"), **FSDP)
        saved = torch.load(os.path.join(run, "checkpoint-2", "pytorch_model_fsdp.bin"), weights_only=True)
        results[kind]["saved keys"] = sorted(saved)
    return results


def test_lora_and_dpo_under_fsdp2_train_like_one_process_and_resume_from_a_checkpoint_exactly(tmp_path):
    """2 ranks x 2 samples x accumulation 2 against one process x 2 samples x accumulation 4: the same global batch
    of the same micro-batches (a micro-batch of 4 pads differently, which moves GPT-2's numbers by 1e-6 on its own).
    Losses and rewards within 1e-6, the trained LoRA adapters within 1e-6; full models within 1e-4: the attention's
    key bias has no true gradient (softmax ignores it), and AdamW turns its float noise (1e-10) into steps of the
    learning rate's size, 6e-5 apart after 4 steps."""
    results = run_on_ranks(_fsdp_runs, 2, args=(str(tmp_path),), timeout=240)[0]
    for kind in FSDP_KINDS:
        one = run_trl(kind, "impel", str(tmp_path / f"{kind}-one"), gradient_accumulation_steps=4, bf16=False)
        bound = 1e-6 if kind == "sft_lora" else 1e-4
        assert max_diff(results[kind]["weights"], one["weights"]) <= bound, kind
        assert results[kind]["loss"] == pytest.approx(one["loss"], abs=1e-6), kind
        assert results[kind]["reward"] == pytest.approx(one["reward"], abs=1e-6), kind
        assert results[kind]["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
        assert results[f"{kind} resumed"]["step"] == 4
        assert max_diff(results[f"{kind} resumed"]["weights"], results[kind]["weights"]) == 0.0, kind
        assert results[f"{kind} resumed"]["loss"][2:] == results[kind]["loss"][2:]
    # the LoRA run's checkpoint holds its adapters (the trainable parameters), plus the tied lm_head weight that
    # torch's ignore_frozen_params keeps (named_parameters lists a tied weight once), as Accelerate's FSDP2 one does
    adapters = results["sft_lora"]["saved keys"]
    assert len(adapters) == 5 and [k for k in adapters if "lora_" not in k] == ["base_model.model.lm_head.weight"]
    assert len(results["dpo"]["saved keys"]) > len(adapters)  # a full model's holds every parameter
