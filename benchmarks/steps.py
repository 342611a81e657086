"""Steps per second of the same training loop written three ways: by hand in torch, with impel, with Accelerate.

Cells: a small MLP (where fixed per-step costs show) and a small GPT-2 built from a config; one process and 2-rank
DDP (gloo on CPU); plain fp32, 4-step gradient accumulation, and bf16 autocast. In each cell the three loops
start from the same weights and see the same batches; they run interleaved (one timed run of each, then the next
repetition) and their final weights are checked to agree, so they all do the same arithmetic. Reported: steps/s
(median and best over repetitions) and impel/raw, accelerate/raw as ratios of median time per step in the same run.
Targets: impel's time per step within 2% of the hand-written loop, and never slower than Accelerate's.
"""
from __future__ import annotations

import _common  # noqa: F401  (first: pins OMP_NUM_THREADS before torch is imported)

# isort: split

import contextlib
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAME = "steps"
DESCRIPTION = "steps/s: hand-written torch vs impel vs accelerate; MLP and GPT-2; 1 process and 2-rank DDP"
MODES = {"fp32": (1, "no"), "accum4": (4, "no"), "bf16": (1, "bf16")}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_batches(kind: str, n: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + rank)
    if kind == "mlp":
        return [(torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]
    return [(t, t) for t in (torch.randint(0, 512, (4, 64), generator=g) for _ in range(n))]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return F.mse_loss(model(x), y)
    return model(input_ids=x, labels=y).loss


def raw_loop(kind: str, world: int, k: int, precision: str) -> Callable[[list], nn.Module]:
    model = make_model(kind)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(batches: list) -> nn.Module:
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % k == 0
            sync = contextlib.nullcontext() if (world == 1 or last) else model.no_sync()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = loss_of(kind, model, x, y)
                (loss / k).backward()
            if last:
                opt.step()
                opt.zero_grad()
        return model.module if world > 1 else model
    return run


def library_loop(lib: str, kind: str, k: int, precision: str) -> Callable[[list], nn.Module]:
    if lib == "impel":
        from impel import Accelerator
    else:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(False)
        GradientState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=k)
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)

    def run(batches: list) -> nn.Module:
        for x, y in batches:
            with acc.accumulate(model):
                acc.backward(loss_of(kind, model, x, y))
                opt.step()
                opt.zero_grad()
        return acc.unwrap_model(model)
    return run


def measure_cell(kind: str, mode: str, world: int, rank: int, reps: int, steps: int) -> dict[str, Any]:
    k, precision = MODES[mode]
    libs = ["raw", "impel"] + (["accelerate"] if importlib.util.find_spec("accelerate") else [])
    loops = {lib: raw_loop(kind, world, k, precision) if lib == "raw" else library_loop(lib, kind, k, precision)
             for lib in libs}
    batches = make_batches(kind, steps * k, rank)
    finals = {lib: loop(batches[: 2 * k]) for lib, loop in loops.items()}  # warm-up; also the agreement check
    ref = finals["raw"].state_dict()
    tol = 1e-4 if precision == "no" else 5e-2
    for lib, model in finals.items():
        diff = max(float((v.float() - ref[n].float()).abs().max()) for n, v in model.state_dict().items())
        if diff > tol:
            raise RuntimeError(f"{kind}/{mode}/{world}: {lib} disagrees with the raw loop by {diff:.2e}")
    times: dict[str, list[float]] = {lib: [] for lib in libs}
    for _ in range(reps):
        for lib, loop in loops.items():
            if world > 1:
                torch.distributed.barrier()
            t0 = time.perf_counter()
            loop(batches)
            times[lib].append((time.perf_counter() - t0) / steps)
    return times


def _on_ranks(cells: list[tuple[str, str]], reps: int, steps: dict[str, int]) -> list[dict]:
    from impel.runtime.ranks.process import ProcessState

    rank = ProcessState(cpu=True).process_index  # joins the gloo group the raw DDP loop uses too
    return [measure_cell(kind, mode, 2, rank, reps, steps[kind]) for kind, mode in cells]


def run(quick: bool = False) -> dict[str, Any]:
    from impel.testing import run_on_ranks

    reps = 2 if quick else 7
    steps = {"mlp": 20 if quick else 200, "gpt2": 3 if quick else 20}
    cells = [(kind, mode) for kind in ("mlp", "gpt2") for mode in MODES]
    results: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    for kind, mode in cells:
        results[(kind, mode, 1)] = measure_cell(kind, mode, 1, 0, reps, steps[kind])
    per_rank = run_on_ranks(_on_ranks, 2, args=(cells, reps, steps), timeout=1800)
    for (kind, mode), times in zip(cells, per_rank[0]):
        results[(kind, mode, 2)] = times
    rows = []
    for (kind, mode, world), times in results.items():
        raw = statistics.median(times["raw"])
        row: dict[str, Any] = {"model": kind, "mode": mode, "ranks": world,
                               "raw_steps_s": 1 / raw, "impel_steps_s": 1 / statistics.median(times["impel"]),
                               "impel/raw": statistics.median(times["impel"]) / raw}
        if "accelerate" in times:
            row["accelerate_steps_s"] = 1 / statistics.median(times["accelerate"])
            row["accelerate/raw"] = statistics.median(times["accelerate"]) / raw
        row["ok"] = row["impel/raw"] <= 1.02 and row["impel/raw"] <= row.get("accelerate/raw", float("inf"))
        rows.append(row)
    met = sum(r["ok"] for r in rows)
    summary = [f"time per step ratios are medians over {reps} interleaved repetitions; target impel/raw <= 1.02 "
               f"and <= accelerate/raw: met in {met}/{len(rows)} cells"]
    return {"rows": rows, "summary": summary, "environment": _common.environment(),
            "raw_seconds_per_step": {f"{k}/{m}/{w}": t for (k, m, w), t in results.items()}}
