"""The cost of casting a mixed-precision model's outputs to fp32 (Accelerate's behaviour, impel's default).

Under bf16/fp16 autocast a prepared model returns float32 outputs, as Accelerate's does (``convert_outputs_to_fp32``);
``Accelerator(cast_outputs_to_fp32=False)`` returns them as computed. The cast is one elementwise copy of every
floating output tensor per forward, so it grows with the logits: a GPT-2 LM head returns ``batch x seq x vocab``
logits. Three loops on the same batches and weights, bf16 autocast, one process, interleaved repetitions:

* ``raw``: a hand-written ``torch.autocast`` loop (no cast);
* ``impel``: the default (outputs cast to fp32);
* ``impel, no cast``: ``cast_outputs_to_fp32=False``.

Reported: median time per step and the cast's share (``impel`` / ``impel, no cast``), for a small and a larger
vocabulary. The loss is computed from the logits outside the model (as training scripts with custom losses do) and
upcasts them to fp32 as mixed-precision recipes do, so without impel's cast the same copy happens in the loss: the
cast moves, it is not added. Measured on this CPU (bf16, batch 4 x 64): +0.9% per step at vocabulary 512 (0.5 MB of
fp32 logits), -1.3% at 8192 (8.4 MB), both within the run's noise; impel/raw 1.04 and 0.98.
"""
from __future__ import annotations

import _common  # noqa: F401  (first: pins OMP_NUM_THREADS before torch is imported)

# isort: split

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAME = "output_cast"
BATCH, SEQ = 4, 64
DESCRIPTION = "bf16 GPT-2: outputs cast to fp32 (Accelerate's default) vs returned as computed vs raw autocast"


def make_model(vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=vocab, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))


def raw_loop(vocab: int) -> Callable[[list[torch.Tensor]], nn.Module]:
    model = make_model(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(batches: list[torch.Tensor]) -> nn.Module:
        for ids in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            lm_loss(logits, ids).backward()
            opt.step()
            opt.zero_grad()
        return model
    return run


def impel_loop(vocab: int, cast: bool) -> Callable[[list[torch.Tensor]], nn.Module]:
    from impel import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16", cast_outputs_to_fp32=cast)
    model = make_model(vocab)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def run(batches: list[torch.Tensor]) -> nn.Module:
        for ids in batches:
            logits = model(input_ids=ids).logits
            assert logits.dtype == (torch.float32 if cast else torch.bfloat16)
            acc.backward(lm_loss(logits, ids))
            opt.step()
            opt.zero_grad()
        return acc.unwrap_model(model)
    return run


def measure(vocab: int, reps: int, steps: int) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(steps)]
    loops = {"raw": raw_loop(vocab), "impel": impel_loop(vocab, True), "impel, no cast": impel_loop(vocab, False)}
    for loop in loops.values():
        loop(batches[:2])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(reps):
        for name, loop in loops.items():
            t0 = time.perf_counter()
            loop(batches)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def run(quick: bool = False) -> dict[str, Any]:
    reps, steps = (2, 3) if quick else (5, 5)
    rows = []
    for vocab in (512, 8192):
        times = measure(vocab, reps, steps)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"vocab": vocab, "logits_MB_fp32": BATCH * SEQ * vocab * 4 / 1e6,
                     "raw_ms": 1e3 * med["raw"], "impel_ms": 1e3 * med["impel"],
                     "impel_no_cast_ms": 1e3 * med["impel, no cast"],
                     "cast_share": med["impel"] / med["impel, no cast"] - 1,
                     "impel/raw": med["impel"] / med["raw"], "no_cast/raw": med["impel, no cast"] / med["raw"]})
    summary = [f"medians over {reps} interleaved repetitions of {steps} bf16 steps (batch {BATCH} x {SEQ} tokens); "
               "cast_share = impel (fp32 outputs) / impel with cast_outputs_to_fp32=False - 1"]
    return {"rows": rows, "summary": summary, "environment": _common.environment()}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2, default=str))
