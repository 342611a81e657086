"""Long runs keep their footprint flat: a 2-rank job of a few thousand steps (DDP and FSDP2 over gloo), with a
``gather_for_metrics`` evaluation and a ``save_state`` (automatic naming, ``total_limit=2`` rotation) every few
hundred steps. Each rank reports its resident memory (VmRSS), open file descriptors and threads after the first
evaluate-and-save cycle (the warm-up: first-time imports and allocator pools) and at the end. Targets: RSS growth
under 2%, no growth in descriptors or threads."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import _common

NAME = "long_run"
DESCRIPTION = "RSS / fds / threads per rank at the start and end of a 2-rank run with evals and rotating saves"

JOB = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from impel import Accelerator, ProjectConfiguration

    steps, every = int(sys.argv[1]), int(sys.argv[2])
    acc = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[3], automatic_checkpoint_naming=True,
                                                          total_limit=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = DataLoader(TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,))), batch_size=16,
                       shuffle=True)
    evaluation = DataLoader(TensorDataset(torch.randn(500, 64), torch.randint(0, 10, (500,))), batch_size=32)
    model, optimizer, train, evaluation = acc.prepare(model, optimizer, train, evaluation)

    def footprint():
        with open("/proc/self/status") as fh:
            rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        return {"rss_kb": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task"))}

    step, samples, accuracy = 0, [], None
    while step < steps:
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % every == 0:
                model.eval()
                hits = 0
                with torch.no_grad():
                    for ex, ey in evaluation:
                        preds, refs = acc.gather_for_metrics((model(ex).argmax(-1), ey))
                        hits += int((preds == refs).sum())
                accuracy = hits / len(evaluation.dataset)
                model.train()
                acc.save_state()
                samples.append(footprint())
            if step >= steps:
                break
    start, middle, end = samples[0], samples[len(samples) // 2], footprint()
    saved = sorted(os.listdir(os.path.join(sys.argv[3], "checkpoints")))
    row = {"rank": acc.process_index, "start": start, "middle": middle, "end": end, "steps": step, "accuracy": accuracy,
           "checkpoints": saved, "samples": samples}
    os.write(1, ("LONGRUN " + json.dumps(row) + "\\n").encode())  # one write: the ranks share the pipe
    acc.end_training()
""")


def _one(strategy: str, steps: int, every: int, root: Path) -> list[dict[str, Any]]:
    where = root / strategy
    where.mkdir()
    (where / "job.py").write_text(JOB)
    flags = ["--use_fsdp"] if strategy == "fsdp" else []
    cmd = [sys.executable, "-m", "impel.commands.main", "launch", "--cpu", "--num_processes", "2", *flags,
           str(where / "job.py"), str(steps), str(every), str(where / "project")]
    res = subprocess.run(cmd, cwd=where, capture_output=True, text=True, timeout=3600, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{strategy} long run failed (exit {res.returncode}):\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    rows = []
    for line in res.stdout.splitlines():
        if line.startswith("LONGRUN "):
            r = json.loads(line[len("LONGRUN "):])
            s, m, e = r["start"], r["middle"], r["end"]
            t = r["samples"][min(2, len(r["samples"]) - 1)]
            rows.append({"strategy": strategy, "rank": r["rank"], "steps": r["steps"],
                         "saves_kept": len(r["checkpoints"]),
                         "rss_start_mb": s["rss_kb"] / 1024, "rss_end_mb": e["rss_kb"] / 1024,
                         "rss_growth_pct": 100.0 * (e["rss_kb"] - s["rss_kb"]) / s["rss_kb"],
                         "after_3rd_save_pct": 100.0 * (e["rss_kb"] - t["rss_kb"]) / t["rss_kb"],
                         "second_half_pct": 100.0 * (e["rss_kb"] - m["rss_kb"]) / m["rss_kb"],
                         "fds_start": s["fds"], "fds_end": e["fds"], "threads_start": s["threads"],
                         "threads_end": e["threads"],
                         "rss_mb_per_save": [round(x["rss_kb"] / 1024, 1) for x in r["samples"]]})
    return sorted(rows, key=lambda r: r["rank"])


def run(quick: bool = False) -> dict[str, Any]:
    steps, every = (400, 100) if quick else (3000, 250)
    with tempfile.TemporaryDirectory(prefix="impel-long-run-") as tmp:
        rows = [row for strategy in ("ddp", "fsdp") for row in _one(strategy, steps, every, Path(tmp))]
    worst = max(r["rss_growth_pct"] for r in rows)
    warm = max(r["after_3rd_save_pct"] for r in rows)
    late = max(r["second_half_pct"] for r in rows)
    flat = all(r["fds_end"] <= r["fds_start"] and r["threads_end"] <= r["threads_start"] for r in rows)
    summary = [f"{steps} steps, evaluate + save_state every {every} (total_limit=2): worst RSS growth "
               f"{worst:.2f}% from the first save (target < 2%), {warm:.2f}% from the third, over the second half "
               f"{late:.2f}%, descriptors and threads {'flat' if flat else 'GREW'}"]
    return {"rows": rows, "summary": summary, "environment": _common.environment()}


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(_common.format_table(result["rows"]))
    print("\n".join(result["summary"]))
