"""TRL's trainers on a tiny GPT-2 (2 layers, hidden 32) with a character tokenizer and local data (no hub).

``run_trl(kind, route, output_dir, **overrides)`` trains one TRL trainer as TRL's documentation writes it, on
Accelerate (``route="accelerate"``: TRL's class itself) or on impel (``route="impel"``: ``on_impel(cls)``, the
documented route), and returns the final weights, the logged losses and rewards and the Accelerator's module;
``gradient_free(kind, output_dir)``: the elements of its model that take no gradient.
``kind``: "sft", "sft_lora" (a LoRA ``peft_config``), "dpo", "dpo_sync" (``sync_ref_model``), "reward", "grpo".
"""
from __future__ import annotations

import os
from typing import Any

import torch

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"
KINDS = ("sft", "sft_lora", "dpo", "dpo_sync", "reward", "grpo")
# every run: 4 optimizer steps of 2 micro-batches of 2 samples per process
COMMON = {"max_steps": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
          "report_to": [], "use_cpu": True, "logging_steps": 1, "save_strategy": "no", "seed": 1,
          "disable_tqdm": True, "lr_scheduler_type": "constant"}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=48, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0)


def tiny_gpt2(head: str = "lm") -> Any:
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(0)
    if head == "score":
        return GPT2ForSequenceClassification(_config().__class__(**dict(_config().to_dict(), num_labels=1)))
    return GPT2LMHeadModel(_config())


_WORDS = ["hello world", "good morning", "the cat sat", "a dog ran", "big red sun", "cold blue sea", "hi there",
          "we go on", "tea is hot", "one two", "quiet night", "a fox hid", "rain fell", "so it goes", "be kind",
          "new day"]


def dataset(kind: str) -> Any:
    from datasets import Dataset

    words = _WORDS * 2
    if kind.startswith("sft"):
        return Dataset.from_dict({"text": words})
    if kind.startswith("dpo"):
        return Dataset.from_dict({"prompt": [w[:3] for w in words], "chosen": [w[3:] for w in words],
                                  "rejected": [w[3:][::-1] for w in words]})
    if kind == "reward":
        return Dataset.from_dict({"chosen": words, "rejected": [w[::-1] for w in words]})
    return Dataset.from_dict({"prompt": [w[:4] for w in words]})


def distinct_letters(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward function: how many different characters a completion holds."""
    return [float(len(set(c))) for c in completions]


def _trainer(kind: str, route: str, output_dir: str, overrides: dict[str, Any]) -> Any:
    import trl

    from impel.trainer import on_impel

    classes = {"sft": (trl.SFTTrainer, trl.SFTConfig), "dpo": (trl.DPOTrainer, trl.DPOConfig),
               "reward": (trl.RewardTrainer, trl.RewardConfig), "grpo": (trl.GRPOTrainer, trl.GRPOConfig)}
    trainer_class, config_class = classes[kind.split("_")[0]]
    if route == "impel":
        trainer_class = on_impel(trainer_class)
    options = dict(COMMON, **overrides)
    extra: dict[str, Any] = {}
    if kind.startswith("dpo"):
        extra["ref_model"] = tiny_gpt2()  # TRL would load it again by the model's hub name
    if kind == "dpo_sync":
        options.update(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    if kind == "grpo":
        options.update(num_generations=2, max_completion_length=4, generation_batch_size=4)
        extra["reward_funcs"] = distinct_letters
    if kind == "sft_lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
    args = config_class(output_dir=output_dir, **options)
    model = tiny_gpt2("score" if kind == "reward" else "lm")
    return trainer_class(model=model, args=args, train_dataset=dataset(kind), processing_class=tokenizer(), **extra)


def _weights(model: Any) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _reward(row: dict[str, Any]) -> Any:
    """GRPO's mean reward, DPO's chosen reward, the reward model's margin (chosen minus rejected: its rewards
    themselves hold ln_f's bias, which no pairwise loss trains)."""
    return row.get("reward", row.get("rewards/chosen", row.get("margin")))


def run_trl(kind: str, route: str, output_dir: str, resume: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Train one TRL trainer; return its weights, logged losses (and GRPO's rewards), the Accelerator's module."""
    if "accelerate" in __import__("sys").modules:  # each run starts from no Accelerate state, as a fresh script
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()
    trainer = _trainer(kind, route, output_dir, overrides)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"weights": _weights(model), "loss": [row["loss"] for row in history if "loss" in row],
            "reward": [_reward(row) for row in history if "loss" in row],
            "accelerator": type(trainer.accelerator).__module__, "step": trainer.state.global_step,
            "checkpoints": sorted(d for d in os.listdir(output_dir) if d.startswith("checkpoint-"))
            if os.path.isdir(output_dir) else []}


def run_kinds(kinds: tuple[str, ...], route: str, output_dir: str, overrides: dict[str, Any],
              resumed: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`run_trl` over several kinds in one process (a ``run_on_ranks`` target); the ``resumed`` kinds save
    every 2 steps and are run again from checkpoint-2 (``results[f"{kind} resumed"]``)."""
    import torch.distributed as dist

    results = {}
    for kind in kinds:
        run = os.path.join(output_dir, kind)
        saving = {"save_strategy": "steps", "save_steps": 2} if kind in resumed else {}
        results[kind] = run_trl(kind, route, run, **overrides, **saving)
        if kind in resumed:
            results[f"{kind} resumed"] = run_trl(kind, route, f"{run}-resumed",
                                                 resume=os.path.join(run, "checkpoint-2"), **overrides)
    results["world"] = dist.get_world_size() if dist.is_initialized() else 1
    return results


def gradient_free(kind: str, output_dir: str, **overrides: Any) -> dict[str, torch.Tensor]:
    """The parameter elements of ``kind``'s model that take no gradient, per parameter name (boolean masks): the
    float64 gradient of every micro-batch of the one-process run (accumulation 4), at the initial weights, is below
    1e-9 of the largest one (float64 noise is 1e-16 of it; a true gradient is orders above)."""
    trainer = _trainer(kind, "impel", output_dir, dict({"bf16": False, "gradient_accumulation_steps": 4}, **overrides))
    model = trainer.model.double().train()
    if getattr(trainer, "ref_model", None) is not None:
        trainer.ref_model.double()
    largest: dict[str, torch.Tensor] = {}
    for batch in trainer.get_train_dataloader():
        model.zero_grad()
        trainer.compute_loss(model, batch).backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                largest[name] = torch.maximum(largest.get(name, torch.zeros_like(param)), param.grad.abs())
    scale = max(grad.max() for grad in largest.values())
    return {name: grad <= 1e-9 * scale for name, grad in largest.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
             excluded: dict[str, torch.Tensor] | None = None) -> float:
    """The largest elementwise difference; ``excluded``: masks of elements left out, per name."""
    assert a.keys() == b.keys()
    kept = {k: ~excluded[k] if excluded and k in excluded else torch.ones_like(a[k], dtype=torch.bool) for k in a}
    return max(((a[k].float() - b[k].float()).abs() * kept[k]).max().item() for k in a)
