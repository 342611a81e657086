"""TRL 1.16's trainers on 2 CPU ranks through ``impel.trainer.on_impel``: the same weights, losses and rewards as TRL
on Accelerate under the same launch (``ACCELERATE_USE_CPU=1``), each resumed under DDP from a mid-run checkpoint
to the uninterrupted run, and under impel's FSDP2 plain SFT, a LoRA run (adapter-only checkpoints), a DPO run (its
reference model sharded by TRL with the plugin's policies), a DPO run with ``sync_ref_model`` (the policy mixed into
that reference model) and a reward model train like one process at the same global batch and resume from a mid-run
checkpoint exactly; GRPO under FSDP2 trains like GRPO under DDP on the same 2 ranks, SFT in bf16 under FSDP2 like
one FSDP2 process under the same mixed-precision policy."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from impel.testing import run_on_ranks  # noqa: E402
from trl_helpers import KINDS, gradient_free, max_diff, run_kinds, run_trl, tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.multiprocess

# fp32 (TRL's configs default to bf16, which FSDP2 applies to the parameters, autocast on one process to the matmuls)
FSDP = {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}, "bf16": False}
FSDP_KINDS = ("sft", "sft_lora", "dpo", "dpo_sync", "reward")
BF16 = dict(FSDP, bf16=True)  # the plugin's MixedPrecisionPolicy: bf16 parameters in the forward, fp32 reduction


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
    results["grpo"] = run_trl("grpo", "impel", os.path.join(output_dir, "grpo"), **FSDP)
    results["grpo ddp"] = run_trl("grpo", "impel", os.path.join(output_dir, "grpo-ddp"), bf16=False)
    results["sft bf16"] = run_trl("sft", "impel", os.path.join(output_dir, "sft-bf16"), **BF16)
    return results


def _one_fsdp_rank(output_dir: str) -> dict:
    """SFT in bf16 on one FSDP2 rank (the same policy), fed the 2 ranks' micro-batches."""
    return run_trl("sft", "impel", os.path.join(output_dir, "sft-bf16-one"), gradient_accumulation_steps=4, **BF16)


def _update_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """How far apart two runs' weights end, relative to how far ``b`` moved from the initial weights (norms)."""
    start = tiny_gpt2().state_dict()
    gap = sum(((a[k] - b[k]) ** 2).sum() for k in a)
    return float((gap / sum(((b[k] - start[k]) ** 2).sum() for k in a)).sqrt())


def _assert_bf16_like_one_fsdp_rank(two: dict, one: dict, fp32: dict) -> None:
    """TRL's default bf16 under FSDP2 on 2 ranks against one FSDP2 process under the same MixedPrecisionPolicy
    (Accelerate runs no FSDP on CPU; one process without FSDP autocasts only the matmuls: a bf16-sized gap, 1.3e-4
    in the first loss, that would hide the 2 ranks' own). Until the fp32 weights' float noise flips a bf16 rounding
    the two compute the same bf16 forwards and the same fp32-reduced update: the first 2 losses within 1e-6 (2.4e-7
    measured). Then flipped roundings (2^-8 each) move the later losses by 4.5e-5 and the weights by 1.3% of their
    update (measured): bounds 5e-4 and 3%, where bf16 itself (against fp32) moves the first loss by 8.9e-5, the
    third by 1e-3 and the weights by 7%."""
    assert abs(two["loss"][0] - fp32["loss"][0]) > 1e-5  # the bf16 policy is in effect
    assert two["loss"][:2] == pytest.approx(one["loss"][:2], abs=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], abs=5e-4)
    assert _update_gap(two["weights"], one["weights"]) <= 0.03


def _no_true_gradient(kind: str, output_dir: str) -> dict[str, torch.Tensor]:
    """The elements of ``kind``'s full model that take no gradient (float64, one process), checked to be those
    that cannot: the attention's key bias (a third of ``c_attn.bias``: it shifts every key's score by the same
    amount, which softmax ignores), in the pairwise reward model ``ln_f.bias`` (it adds the same score to the
    chosen and the rejected sample, and only their difference is trained), and embedding rows of positions (and, in
    the reward model whose head is not tied to them, tokens) that no sample holds."""
    free = gradient_free(kind, output_dir)
    expected = {f"transformer.h.{i}.attn.c_attn.bias" for i in range(2)} | {"transformer.wpe.weight"}
    if kind == "reward":
        expected |= {"transformer.ln_f.bias", "transformer.wte.weight"}
        assert free["transformer.ln_f.bias"].all()
    assert {name for name, mask in free.items() if mask.any()} == expected, kind
    for i in range(2):  # q, k, v biases: exactly the key's (n_embd 32)
        assert free[f"transformer.h.{i}.attn.c_attn.bias"].nonzero().flatten().tolist() == list(range(32, 64))
    return free


def test_trl_under_fsdp2_trains_like_one_process_and_resumes_from_a_checkpoint_exactly(tmp_path):
    """2 ranks x 2 samples x accumulation 2 against one process x 2 samples x accumulation 4: the same global batch
    of the same micro-batches (a micro-batch of 4 pads differently, which moves GPT-2's numbers by 1e-6 on its own).
    Losses and rewards (the reward model's margins) within 1e-6, the trained LoRA adapters within 1e-6, full models
    within 1e-5 on every element that takes a gradient (3.2e-6 measured, in the reward model's MLP, whose gradients
    are differences of the chosen and the rejected samples' and keep their float noise, which AdamW's normalisation
    scales up; a wrong gradient moves an element by up to the learning rate, 1e-2, per step). The elements that take
    none (named and checked by ``_no_true_gradient``) move by steps of the learning rate's size from float noise
    (1e-10), up to 8.5e-4 apart after 4 steps, and change nothing the loss sees. GRPO cannot be compared with one
    process (each rank samples its completions from its own RNG stream): it is compared with the same 2 ranks under
    DDP (proven equal to TRL + Accelerate above)."""
    results = run_on_ranks(_fsdp_runs, 2, args=(str(tmp_path),), timeout=240)[0]
    _assert_bf16_like_one_fsdp_rank(results["sft bf16"], run_on_ranks(_one_fsdp_rank, 1, args=(str(tmp_path),))[0],
                                    results["sft"])
    for kind in FSDP_KINDS:
        one = run_trl(kind, "impel", str(tmp_path / f"{kind}-one"), gradient_accumulation_steps=4, bf16=False)
        free = None if kind == "sft_lora" else _no_true_gradient(kind, str(tmp_path / f"{kind}-free"))
        bound = 1e-6 if kind == "sft_lora" else 1e-5
        assert max_diff(results[kind]["weights"], one["weights"], excluded=free) <= bound, kind
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
    grpo, ddp = results["grpo"], results["grpo ddp"]
    assert max_diff(grpo["weights"], ddp["weights"]) <= 1e-6
    assert grpo["loss"] == pytest.approx(ddp["loss"], abs=1e-6)
    assert grpo["reward"] == pytest.approx(ddp["reward"], abs=1e-6)
