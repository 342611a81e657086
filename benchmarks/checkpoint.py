"""Checkpoint throughput: save_state / load_state of the ~100M-parameter GPT-2 (weights + AdamW states) on 2 CPU
ranks, full (DDP: safetensors + torch files) and sharded (FSDP SHARDED_STATE_DICT: DCP) and FSDP FULL_STATE_DICT,
against the disk's sequential write bandwidth measured in the same run (a file of the checkpoint's size written
in 16 MiB blocks and fsynced). Target: save at 50% or more of the disk bandwidth.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
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


def disk_write_bandwidth(directory: str, size: int) -> float:
    block = os.urandom(16 << 20)
    path = os.path.join(directory, "bandwidth.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        written = 0
        while written < size:
            fh.write(block)
            written += len(block)
        fh.flush()
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return written / elapsed


def run(quick: bool = False) -> dict[str, Any]:
    n_layer = 2 if quick else 14
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for name, flags in FORMATS.items():
            ckpt = os.path.join(home, name.split()[0] + "-" + str(len(rows)))
            try:
                reports = launch(flags, [str(n_layer), ckpt], home)
            except RuntimeError as exc:
                rows.append({"format": name, "error": str(exc).strip().splitlines()[-1][:100]})
                continue
            size = reports[0]["checkpoint_bytes"]
            disk = statistics.median(disk_write_bandwidth(home, size) for _ in range(3))
            save = size / max(r["save_s"] for r in reports)
            rows.append({"format": name, "size_GB": size / 1e9, "save_s": max(r["save_s"] for r in reports),
                         "first_save_s": max(r["first_save_s"] for r in reports),
                         "load_s": max(r["load_s"] for r in reports), "save_GB_s": save / 1e9,
                         "load_GB_s": size / max(r["load_s"] for r in reports) / 1e9, "disk_GB_s": disk / 1e9,
                         "save/disk": save / disk, "target": ">= 0.50", "ok": save / disk >= 0.5, "error": None})
    return {"rows": rows, "environment": _common.environment(), "n_layer": n_layer,
            "summary": ["save/disk: checkpoint bytes / slowest rank's save_state time (the run's second save; "
                        "first_save_s includes one-time imports), over the disk's fsynced sequential write "
                        "bandwidth for a file of the same size (median of 3)"]}
