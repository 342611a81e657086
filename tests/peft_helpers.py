"""PEFT LoRA in Accelerate's custom-loop recipe on impel's Accelerator (tiny GPT-2, frozen base + trainable adapters).

``lora_loop(strategy, batch, output_dir)`` trains 3 optimizer steps of 2 accumulated micro-batches, saves the adapter
with Accelerate's recipe (``unwrap_model(model).save_pretrained(dir, is_main_process=..., state_dict=
accelerator.get_state_dict(model))``), loads it back with PEFT and returns the weights, the losses and what the plain
``save_pretrained(dir)`` did.
"""
from __future__ import annotations

import os
from typing import Any

import torch


def _batches(batch: int, rank: int, world: int) -> list[torch.Tensor]:
    """24 sequences of 12 tokens in micro-batches of ``batch`` per rank (rank r takes the r-th of each group)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 48, (24, 12), generator=g)
    return [data[i * batch * world + rank * batch:i * batch * world + (rank + 1) * batch]
            for i in range(24 // (batch * world))]


def _build(strategy: str, accumulation: int, library: str = "impel") -> tuple[Any, Any, Any]:
    """``library``: "impel", or "accelerate" (Accelerate's own Accelerator, the reference; its state reset first, as
    a fresh script has none)."""
    import importlib

    from peft import LoraConfig, get_peft_model

    from trl_helpers import tiny_gpt2

    if library == "accelerate":
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    lib = importlib.import_module(library)
    fsdp = lib.FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["GPT2Block"]) if strategy == "fsdp" \
        else None
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=accumulation, fsdp_plugin=fsdp)
    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                   lora_dropout=0.0, fan_in_fan_out=True))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _train(accelerator: Any, model: Any, optimizer: Any, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    return losses


def lora_loop(strategy: str, batch: int, output_dir: str, resume_at: int | None = None,
              accumulation: int = 2, library: str = "impel") -> dict[str, Any]:
    """``resume_at=k``: after k micro-batches ``save_state``, then a fresh Accelerator, model and optimizer
    ``load_state`` it and train the rest (Accelerate's resume recipe). ``library``: see :func:`_build`."""
    import torch.distributed as dist
    from peft import PeftModel

    from trl_helpers import tiny_gpt2

    accelerator, model, optimizer = _build(strategy, accumulation, library)
    batches = _batches(batch, accelerator.process_index, accelerator.num_processes)
    if resume_at is None:
        losses = _train(accelerator, model, optimizer, batches)
    else:
        losses = _train(accelerator, model, optimizer, batches[:resume_at])
        accelerator.save_state(os.path.join(output_dir, "state"))
        accelerator, model, optimizer = _build(strategy, accumulation, library)
        accelerator.load_state(os.path.join(output_dir, "state"))
        losses += _train(accelerator, model, optimizer, batches[resume_at:])
    unwrapped = accelerator.unwrap_model(model)
    try:
        unwrapped.save_pretrained(os.path.join(output_dir, "plain"))
        plain = "saved"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        plain = f"{type(exc).__name__}: {exc}"
    adapter_dir = os.path.join(output_dir, "adapter")
    unwrapped.save_pretrained(adapter_dir, is_main_process=accelerator.is_main_process,
                              state_dict=accelerator.get_state_dict(model))
    accelerator.wait_for_everyone()
    trained = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items() if "lora_" in k}
    loaded = PeftModel.from_pretrained(tiny_gpt2(), adapter_dir)
    reloaded = {k: v.detach().clone() for k, v in loaded.state_dict().items() if "lora_" in k}
    return {"trained": trained, "reloaded": reloaded, "losses": losses, "plain": plain,
            "world": dist.get_world_size() if dist.is_initialized() else 1}


def both_strategies(output_dir: str) -> dict[str, Any]:
    """DDP and FSDP2 in one launch (batch 2 per rank), each also resumed after the first optimizer step."""
    runs = {s: lora_loop(s, 2, os.path.join(output_dir, s)) for s in ("ddp", "fsdp")}
    return runs | {f"{s} resumed": lora_loop(s, 2, os.path.join(output_dir, f"{s}-resumed"), resume_at=2)
                   for s in ("ddp", "fsdp")}
