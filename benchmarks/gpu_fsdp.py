"""GPU section (runs only when CUDA is present): tokens/s and MFU of a ~1B-parameter GPT in bf16 under FSDP2 on
one GPU, with and without torch.compile, through the Accelerator. Sized to finish in a few minutes on an H200.
The async-checkpoint row: the time training is blocked by ``save_state(async_save=True)`` (state staged to pinned
CPU memory) against a synchronous ``save_state`` of the same state (SHARDED_STATE_DICT), and the step time while
the background write runs.

MFU = achieved FLOP/s / peak bf16 FLOP/s, with 6 * params * tokens FLOPs per training step (plus attention's
12 * layers * hidden * seq per token) and the peak taken from ``IMPEL_PEAK_TFLOPS`` or a table of known GPUs.
"""
from __future__ import annotations

import os
import time
from typing import Any

import _common

NAME = "gpu_fsdp"
DESCRIPTION = "CUDA only: tokens/s and MFU of a ~1B GPT, bf16, FSDP2 on one GPU, eager and torch.compile"
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def peak_flops(name: str) -> float | None:
    if os.environ.get("IMPEL_PEAK_TFLOPS"):
        return float(os.environ["IMPEL_PEAK_TFLOPS"]) * 1e12
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def _step(acc: Any, model: Any, opt: Any, x: Any) -> None:
    # a function of its own, not a closure: `del model, opt` below then frees them (a closure's cells would be
    # emptied while the closure still names them)
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()


def measure(compile_model: bool, steps: int, seq: int, batch: int) -> dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    # compiled through the Accelerator, as users ask for it: under FSDP2 each transformer block is compiled before
    # it is sharded (impel.runtime.step.compile), not the whole sharded model afterwards
    acc = Accelerator(mixed_precision="bf16", dynamo_backend="inductor" if compile_model else None)
    cfg = GPT2Config(n_layer=20, n_embd=2048, n_head=16, vocab_size=32000, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=acc.device)
    for _ in range(3):
        _step(acc, model, opt, x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(acc, model, opt, x)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = steps * batch * seq
    flops = tokens * (6 * params + 12 * cfg.n_layer * cfg.n_embd * seq)
    peak = peak_flops(torch.cuda.get_device_name())
    out = {"compile": compile_model, "params_B": params / 1e9, "tokens_s": tokens / elapsed,
           "tflops": flops / elapsed / 1e12, "mfu": (flops / elapsed / peak) if peak else None,
           "max_mem_GB": torch.cuda.max_memory_allocated() / 1e9}
    acc.end_training()
    del model, opt
    torch.cuda.empty_cache()
    return out


def measure_checkpoint(steps: int, seq: int, batch: int) -> dict[str, Any]:
    """Blocked time of an asynchronous save vs a synchronous one (median of 3 after a warm-up of each), the
    background write's time to the commit, and the mean step time while it runs."""
    import shutil
    import statistics
    import tempfile

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from impel import Accelerator
    from impel.runtime.ranks.process import ProcessState

    ProcessState._reset()
    acc = Accelerator(mixed_precision="bf16")
    cfg = GPT2Config(n_layer=20, n_embd=2048, n_head=16, vocab_size=32000, n_positions=seq)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=acc.device)
    _step(acc, model, opt, x)
    sync, blocked, background, during = [], [], [], []
    with tempfile.TemporaryDirectory(dir=os.environ.get("IMPEL_BENCH_DIR")) as root:
        for rep in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            acc.save_state(os.path.join(root, f"sync{rep}"), async_save=False)
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            acc.save_state(os.path.join(root, f"async{rep}"), async_save=True)
            blocked.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            for _ in range(steps):
                _step(acc, model, opt, x)
            torch.cuda.synchronize()
            during.append((time.perf_counter() - t1) / steps)
            acc.wait_for_checkpoint()
            background.append(time.perf_counter() - t0)
            for name in (f"sync{rep}", f"async{rep}"):
                shutil.rmtree(os.path.join(root, name))
    acc.end_training()
    del model, opt
    torch.cuda.empty_cache()
    ratio = statistics.median(blocked[1:]) / statistics.median(sync[1:])
    return {"checkpoint": "async vs sync (SHARDED_STATE_DICT)", "sync_save_s": statistics.median(sync[1:]),
            "async_blocked_s": statistics.median(blocked[1:]), "blocked/sync": ratio,
            "background_s": statistics.median(background[1:]), "step_s_during_write": statistics.mean(during[1:]),
            "target": "blocked/sync <= 0.10", "ok": ratio <= 0.10}


def run(quick: bool = False) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"rows": [{"skipped": "no CUDA device on this machine"}], "environment": _common.environment()}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      IMPEL_CONFIG='{"distributed_type": "FSDP"}')
    steps = 3 if quick else 20
    rows = [measure(c, steps, seq=2048, batch=8) for c in (False, True)]
    os.environ["IMPEL_CONFIG"] = ('{"distributed_type": "FSDP", "fsdp_config": '
                                  '{"fsdp_state_dict_type": "SHARDED_STATE_DICT"}}')
    rows.append(measure_checkpoint(3 if quick else 10, seq=2048, batch=8))
    return {"rows": rows, "environment": _common.environment(), "gpu": torch.cuda.get_device_name()}
