"""torch.compile on CPU: time per training step of a GPT-2 compiled with inductor through the Accelerator
(``Accelerator(dynamo_backend="inductor")``) against the same loop in eager mode, on one process and on 2 ranks
(DDP over gloo). Both loops start from the same weights and see the same batches; the compiled one is warmed up
(its compile time is reported apart, not in the step time); eager and compiled steps alternate in repetitions so
that a drift of the machine hits both; their final losses are checked to agree (inductor reorders float math:
within 1e-3 relative).

Reported per cell: median time per step eager and compiled, the ratio compiled/eager, and the one-time compile
seconds. Inductor emits C++ for the CPU (a C++ compiler must be on PATH).
"""
from __future__ import annotations

import _common  # noqa: F401  (first: pins OMP_NUM_THREADS before torch is imported)

# isort: split

import statistics
import time
from typing import Any

import torch

NAME = "compile_cpu"
DESCRIPTION = "GPT-2 step time on CPU: eager vs torch.compile (inductor) through the Accelerator; 1 and 2 ranks"
BATCH, SEQ = 4, 128


def make_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _loop(backend: str | None) -> tuple[Any, Any, Any]:
    from impel import Accelerator

    acc = Accelerator(dynamo_backend=backend) if backend else Accelerator()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _steps(acc: Any, model: Any, opt: Any, batches: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds per step over ``batches`` (each rank's) and the last loss."""
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.wait_for_everyone()
    return (time.perf_counter() - t0) / len(batches), float(loss.detach())


def measure(reps: int, steps: int) -> dict[str, Any]:
    """On every rank of the current job (one process or a gloo group): eager vs inductor."""
    from impel.runtime.ranks.process import PartialState

    rank = PartialState().process_index
    gen = torch.Generator().manual_seed(1234 + rank)
    batches = [torch.randint(0, 4096, (BATCH, SEQ), generator=gen) for _ in range(steps)]
    eager = _loop(None)
    compiled = _loop("inductor")
    t0 = time.perf_counter()
    _steps(*compiled, batches[:2])  # compiles forward and backward (and recompiles nothing after)
    compile_s = time.perf_counter() - t0
    _steps(*eager, batches[:2])
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses = {}
    for _ in range(reps):
        for name, loop in (("eager", eager), ("compiled", compiled)):
            per_step, losses[name] = _steps(*loop, batches)
            times[name].append(per_step)
    eager_s, compiled_s = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"eager_ms": eager_s * 1e3, "compiled_ms": compiled_s * 1e3, "compiled/eager": compiled_s / eager_s,
            "compile_s": compile_s, "loss_rel_diff": abs(losses["eager"] - losses["compiled"]) / abs(losses["eager"])}


def _on_rank(reps: int, steps: int) -> dict[str, Any]:
    return measure(reps, steps)


def run(quick: bool = False) -> dict[str, Any]:
    from impel.testing import run_on_ranks

    reps, steps = (1, 2) if quick else (5, 8)
    rows = []
    for world in (1, 2):
        try:
            result = run_on_ranks(_on_rank, world, args=(reps, steps), timeout=1800)[0]
        except Exception as exc:  # noqa: BLE001 - a missing compiler or an inductor failure is a row, not a crash
            rows.append({"ranks": world, "error": str(exc).strip().splitlines()[-1][:120]})
            continue
        rows.append({"ranks": world, **result, "losses_agree": result["loss_rel_diff"] < 1e-3})
    return {"rows": rows, "environment": _common.environment(), "batch": BATCH, "seq": SEQ,
            "summary": ["compiled/eager: median seconds per optimizer step, inductor over eager, same batches and "
                        "weights, interleaved repetitions; compile_s is the one-time cost of the first two steps"]}
