"""A transformers-example-style Trainer script on a tiny causal LM with variable-length, padded sequences.

``run_script(source, ...)`` imports ``Trainer`` / ``TrainingArguments`` from ``source`` ("transformers", or "impel" /
"impel.trainer.hf": the import renamed, nothing else) and returns what the comparison tests read.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

import torch

SEQ = 16
VOCAB = 64


def padded_lm_data(n: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences of 2..15 real tokens padded to 16 (labels -100 and attention 0 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(2, SEQ, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[length:] = -100
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[length:] = 0
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return rows


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(config)


EXAMPLE = {"do_train": True, "do_eval": True, "optim": "adamw_torch", "learning_rate": 5e-3,
           "lr_scheduler_type": "cosine", "warmup_steps": 2, "gradient_checkpointing": True, "max_steps": 6,
           "eval_strategy": "steps", "eval_steps": 2, "logging_steps": 1, "include_num_input_tokens_seen": True,
           "average_tokens_across_devices": True, "eval_accumulation_steps": 2,
           "train_sampling_strategy": "sequential", "per_device_eval_batch_size": 4, "save_strategy": "no",
           "report_to": [], "use_cpu": True, "disable_tqdm": True, "seed": 3}


def _files(output_dir: str) -> list[str]:
    """``checkpoint-N/name`` for every entry (file or folder) of every checkpoint."""
    return [f"{ckpt}/{name}" for ckpt in os.listdir(output_dir) if ckpt.startswith("checkpoint-")
            for name in os.listdir(os.path.join(output_dir, ckpt))]


def _weights(module: Any) -> dict[str, torch.Tensor]:
    """The full weights: FSDP2's DTensors gathered, ZeRO-3's partitions gathered."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}


def _mesh(accelerator: Any) -> tuple[int, int] | None:
    """(dp_replicate_size, dp_shard_size) of the Accelerator's ParallelismConfig, None without one."""
    config = getattr(accelerator, "parallelism_config", None)
    return None if config is None else (config.dp_replicate_size, config.dp_shard_size)


def run_script(source: str, output_dir: str, **overrides: Any) -> dict[str, Any]:
    """Train and evaluate like transformers' examples; return weights, eval losses, lr trace and tokens seen."""
    module = importlib.import_module(source)
    args = module.TrainingArguments(output_dir=output_dir, **dict(EXAMPLE, **overrides))
    trainer = module.Trainer(model=tiny_gpt2(), args=args, train_dataset=padded_lm_data(),
                             eval_dataset=padded_lm_data(12, seed=1))
    if args.do_train:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # as transformers examples do
    final = trainer.evaluate() if args.do_eval else {}
    predicted = trainer.predict(padded_lm_data(12, seed=1)) if args.do_predict else None
    history = trainer.state.log_history
    weights = _weights(trainer.accelerator.unwrap_model(trainer.model))
    return {"weights": {k: v.detach().clone() for k, v in weights.items()},
            "global_step": trainer.state.global_step, "files": sorted(_files(output_dir)),
            "eval_loss": [row["eval_loss"] for row in history if "eval_loss" in row] + [final.get("eval_loss")],
            "loss": [row["loss"] for row in history if "loss" in row],
            "learning_rate": [row["learning_rate"] for row in history if "learning_rate" in row],
            "grad_norm": [row["grad_norm"] for row in history if "grad_norm" in row],
            "tokens_seen": trainer.state.num_input_tokens_seen,
            "best": (trainer.state.best_metric, trainer.state.best_global_step,
                     os.path.basename(trainer.state.best_model_checkpoint or "")),
            "predictions": None if predicted is None else torch.as_tensor(predicted.predictions),
            "test_loss": None if predicted is None else predicted.metrics["test_loss"],
            "accelerator": type(trainer.accelerator).__module__,
            "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
            "mesh": _mesh(trainer.accelerator)}


def run_script_on_rank(source: str, output_dir: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_script` as a ``run_on_ranks`` target: its result also names the world size it ran on."""
    result = run_script(source, output_dir, **overrides)
    import torch.distributed as dist

    result["world"] = dist.get_world_size() if dist.is_initialized() else 1
    return result


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def custom_loop(source: str, mode: str, batch: int, accumulation: int, steps: int = 3) -> dict[str, Any]:
    """A custom loop on ``source``'s Accelerator ("impel" or "accelerate"): SGD on the tiny causal LM, ``steps``
    optimizer steps. ``mode``: "plain" (accumulate() and mean losses), "windows" (impel's item_windows) or "recipe"
    (Accelerate's documented recipe for token-level losses: count the window's items, gather them across ranks,
    multiply the summed loss by accumulation x processes / items)."""
    import contextlib

    from torch.utils.data import DataLoader

    accelerator = importlib.import_module(source).Accelerator(gradient_accumulation_steps=accumulation)
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(padded_lm_data(), batch_size=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    if mode == "recipe":
        iterator = iter(loader)
        for _ in range(steps):
            window = [next(iterator) for _ in range(accumulation)]
            items = sum((b["labels"][..., 1:] != -100).sum() for b in window)
            items = accelerator.gather(items).sum().item()
            for i, b in enumerate(window):
                last = i == len(window) - 1 or accelerator.num_processes == 1
                with contextlib.nullcontext() if last else model.no_sync():
                    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.size(-1)), b["labels"][:, 1:].reshape(-1),
                        ignore_index=-100, reduction="sum")
                    accelerator.backward(loss * accumulation * accelerator.num_processes / items)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    else:
        batches = accelerator.item_windows(loader) if mode == "windows" else loader
        for i, b in enumerate(batches):
            if i == steps * accumulation:
                break
            with accelerator.accumulate(model):
                loss = model(**b).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
    weights = accelerator.unwrap_model(model).state_dict()
    return {"weights": {k: v.detach().clone() for k, v in weights.items()}, "losses": losses,
            "processes": accelerator.num_processes}
