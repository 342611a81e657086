"""Checkpoint throughput: save_state / load_state of the ~100M-parameter GPT-2 (weights + AdamW states) on 2 CPU
ranks, full (DDP: safetensors + torch files) and sharded (FSDP SHARDED_STATE_DICT: DCP) and FSDP FULL_STATE_DICT,
against the disk's sequential write bandwidth measured right before each save (a file of the checkpoint's size
written in 16 MiB blocks and fsynced). Target: save at 50% or more of the disk bandwidth.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import _common
from memory import launch

NAME = "checkpoint"
DESCRIPTION = "save/load GB/s of full and sharded checkpoints vs the disk's sequential write bandwidth"
FORMATS = {
    "DDP (full)": [],
    "FSDP SHARDED_STATE_DICT": ["--use_fsdp", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"],
    "FSDP FULL_STATE_DICT": ["--use_fsdp", "--fsdp_state_dict_type", "FULL_STATE_DICT"],
}


def run(quick: bool = False) -> dict[str, Any]:
    n_layer = 2 if quick else 14
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for name, flags in FORMATS.items():
            ckpt = os.path.join(home, name.split()[0] + "-" + str(len(rows)))
            try:
                reports = launch(flags, [str(n_layer), ckpt], home, malloc_threshold=False)
            except RuntimeError as exc:
                rows.append({"format": name, "error": str(exc).strip().splitlines()[-1][:100]})
                continue
            size = reports[0]["checkpoint_bytes"]
            saves = [max(times) for times in zip(*(r["save_s"] for r in reports))]  # the slowest rank, per save
            ratios = [size / s / disk for s, disk in zip(saves, reports[0]["disk_Bps"])]
            ratio = statistics.median(ratios)
            rows.append({"format": name, "size_GB": size / 1e9, "save_s_min": min(saves),
                         "save_s_median": statistics.median(saves),
                         "first_save_s": max(r["first_save_s"] for r in reports),
                         "load_s": max(r["load_s"] for r in reports),
                         "save_GB_s": size / statistics.median(saves) / 1e9,
                         "load_GB_s": size / max(r["load_s"] for r in reports) / 1e9,
                         "disk_GB_s": statistics.median(reports[0]["disk_Bps"]) / 1e9,
                         "save/disk": ratio, "target": ">= 0.50", "ok": ratio >= 0.5, "error": None})
    return {"rows": rows, "environment": _common.environment(), "n_layer": n_layer,
            "summary": ["save/disk: median over 3 saves of checkpoint bytes / the slowest rank's save_state time, "
                        "each over the disk's fsynced sequential write bandwidth measured just before it for a file "
                        "of the same size; first_save_s (one-time imports included) is not in the ratio"]}
