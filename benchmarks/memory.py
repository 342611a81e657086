"""Memory per rank: DDP vs FSDP FULL_SHARD vs ZeRO-3 on a ~100M-parameter GPT-2 with AdamW on 2 CPU ranks.

Each strategy runs under ``impel launch`` (only the flags change) with ``MALLOC_MMAP_THRESHOLD_=131072``: with
glibc's default, freed memory stays counted in RSS and sharded runs look worse than they are. Reported per rank:
tensor bytes held after prepare and after the first optimizer step, and peak RSS, against the theory of fp32
AdamW: 16 bytes per parameter under DDP (weights 4 + gradients 4 + two Adam moments 8), divided by the world
size when fully sharded. Target: FSDP FULL_SHARD within 10% of the theory.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common

NAME = "memory"
DESCRIPTION = "per-rank tensor bytes and peak RSS: DDP vs FSDP FULL_SHARD vs ZeRO-3, ~100M params, 2 ranks"
WORKER = str(Path(__file__).resolve().parent / "_memory_worker.py")
STRATEGIES = {
    "DDP": [],
    "FSDP FULL_SHARD": ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"],
    "ZeRO-3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag"],
}


def launch(flags: list[str], args: list[str], home: str, malloc_threshold: bool = True,
           worker: str = WORKER) -> list[dict[str, Any]]:
    """Run the worker on 2 ranks; ``malloc_threshold``: return freed memory to the OS (for honest RSS figures;
    throughput benchmarks leave glibc's default, as users do)."""
    impel = str(Path(sys.executable).parent / "impel")
    # no launch config: an empty home and caches (IMPEL_CONFIG_FILE must now name an existing file)
    env = {k: v for k, v in os.environ.items() if k != "IMPEL_CONFIG_FILE"}
    env.update(OMP_NUM_THREADS="1", HOME=home, XDG_CACHE_HOME=os.path.join(home, "cache"),
               HF_HOME=os.path.join(home, "hf"))
    if malloc_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    cmd = [impel, "launch", "--cpu", "--num_processes", "2", *flags, worker, *args]
    proc = subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    return sorted(rows, key=lambda r: r["rank"])


def run(quick: bool = False) -> dict[str, Any]:
    n_layer = 2 if quick else 14
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for name, flags in STRATEGIES.items():
            try:
                reports = launch(flags, [str(n_layer)], home)
            except RuntimeError as exc:
                rows.append({"strategy": name, "error": str(exc).strip().splitlines()[-1][:100]})
                continue
            params, world = reports[0]["params"], reports[0]["world"]
            theory = 16 * params / (world if name != "DDP" else 1)
            held = statistics.mean(r["bytes_after_step"] for r in reports)
            rows.append({"strategy": name, "params_M": params / 1e6,
                         "after_prepare_GB": statistics.mean(r["bytes_after_prepare"] for r in reports) / 1e9,
                         "after_step_GB": held / 1e9, "theory_GB": theory / 1e9, "vs_theory": held / theory,
                         "peak_rss_GB": max(r["peak_rss"] for r in reports) / 1e9,
                         "target": "within 10%" if name == "FSDP FULL_SHARD" else None,
                         "ok": abs(held / theory - 1) <= 0.10 if name == "FSDP FULL_SHARD" else None,
                         "error": None})
    summary = ["bytes: every distinct tensor storage reachable on the rank after the first AdamW step (mean of 2 "
               "ranks); theory: 16 B/param (DDP), 16 B/param / world (fully sharded)"]
    return {"rows": rows, "summary": summary, "environment": _common.environment(), "n_layer": n_layer}
