"""Launch latency: time to exit of a 2-rank script that imports torch and creates an Accelerator, started by
``impel launch``, plain ``torchrun`` and ``accelerate launch``; plus ``impel --help`` and ``import impel`` against
``import torch``. Each figure is measured in this run, interleaved (one repetition of every launcher, then the
next), min and median reported; the target is impel launch <= 1.10 x torchrun (median)."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

NAME = "launch"
DESCRIPTION = "time to exit: impel launch vs torchrun vs accelerate launch (2 CPU ranks), --help, import"

SCRIPT = """import os, sys
import torch
if sys.argv[1] == "impel":
    from impel import Accelerator
    Accelerator(cpu=True)
elif sys.argv[1] == "accelerate":
    from accelerate import Accelerator
    Accelerator(cpu=True)
else:
    import torch.distributed as dist
    dist.init_process_group("gloo")
"""


def _time(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=300, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def commands(script: str, home: str) -> dict[str, list[str]]:
    py = sys.executable
    bin_dir = Path(py).parent
    out = {
        "torchrun (plain torch script)": [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                          script, "torch"],
        "torchrun (impel Accelerator)": [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                         script, "impel"],
        "impel launch": [str(bin_dir / "impel"), "launch", "--cpu", "--num_processes", "2", script, "impel"],
    }
    if shutil.which("accelerate", path=str(bin_dir)):
        out["accelerate launch"] = [str(bin_dir / "accelerate"), "launch", "--cpu", "--num_processes", "2",
                                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                    script, "accelerate"]
    out["impel --help"] = [str(bin_dir / "impel"), "--help"]
    out["python -c 'import impel'"] = [py, "-c", "import impel"]
    out["python -c 'import torch'"] = [py, "-c", "import torch"]
    return out


def run(quick: bool = False) -> dict[str, Any]:
    reps = 2 if quick else 7
    with tempfile.TemporaryDirectory() as home:
        script = os.path.join(home, "noop.py")
        Path(script).write_text(SCRIPT)
        env = dict(os.environ, HOME=home, XDG_CACHE_HOME=os.path.join(home, "cache"),
                   HF_HOME=os.path.join(home, "hf"), OMP_NUM_THREADS="1")  # no launch config anywhere
        env.pop("IMPEL_CONFIG_FILE", None)  # it must now name an existing file
        cmds = commands(script, home)
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for cmd in cmds.values():  # warm the page cache once
            _time(cmd, env, home)
        for _ in range(reps):
            for name, cmd in cmds.items():
                times[name].append(_time(cmd, env, home))
    base = statistics.median(times["torchrun (impel Accelerator)"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        launcher = name in ("impel launch", "accelerate launch", "torchrun (impel Accelerator)")
        rows.append({"command": name, "min_s": min(ts), "median_s": med,
                     "vs_torchrun": round(med / base, 3) if launcher else None,
                     "target": "<= 1.10" if name == "impel launch" else None,
                     "ok": (med / base <= 1.10) if name == "impel launch" else None})
    ratio = statistics.median(times["impel launch"]) / base
    summary = [f"impel launch / torchrun (same script, median of {reps}): {ratio:.3f} "
               f"(target <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})"]
    return {"rows": rows, "summary": summary, "environment": _common.environment(), "repetitions": reps}
