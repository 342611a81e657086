"""The seed exercise's check: the same recipe on 1 process and on 2-process FSDP gives a similar loss curve.

Runs ``examples/train_genre_classifier.py`` twice through ``impel launch``, changing nothing but the number of
processes and one TrainingArguments knob (``--fsdp "full_shard auto_wrap"``): same per-device batch, steps and
learning rate, so the FSDP run trains on twice the effective batch. Then ``impel compare`` reads both runs'
``metrics.jsonl``, aligns them on samples seen, prints how far the train and eval curves are apart (mean and
largest relative difference), the final eval numbers and throughput of both, and draws both curves in one PNG.

Run it::

    python examples/compare_runs.py                         # 40 steps each, results under runs/compare
    python examples/compare_runs.py --max_steps 80 --tolerance 0.05 -- --lines_per_passage 8
    python examples/compare_runs.py --deepspeed examples/configs/zero2.json   # + a 2-process ZeRO-2 run

Arguments after ``--`` go to the training script. Exit code 0 when the mean relative differences are within
``--tolerance``, 1 otherwise (``impel compare``'s).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_genre_classifier.py"


def launch(name: str, processes: int, out: Path, recipe: list[str], knobs: list[str], cpu: bool) -> Path:
    """One training run under ``impel launch`` with a minimal config (only the process count, and the CPU)."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "launch.yaml"
    config.write_text(f"num_processes: {processes}\nnum_machines: 1\n" + ("use_cpu: true\n" if cpu else ""))
    cmd = [sys.executable, "-m", "impel.commands.main", "launch", "--config_file", str(config), str(SCRIPT),
           "--output_dir", str(run_dir), *recipe, *knobs]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    tail = [line for line in result.stdout.splitlines() if line.startswith(("eval accuracy", "impel Trainer"))]
    print("\n".join(f"[{name}] {line}" for line in tail) + f"\n[{name}] {time.perf_counter() - started:.0f} s",
          flush=True)
    if result.returncode != 0:
        raise SystemExit(f"[{name}] exited {result.returncode}:\n{result.stdout[-4000:]}")
    return run_dir / "metrics.jsonl"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="runs/compare")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=16, help="per process (so the FSDP run's global batch doubles)")
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--fsdp", default="full_shard auto_wrap", help="the TrainingArguments.fsdp knob of the 2nd run")
    p.add_argument("--tolerance", type=float, default=0.1, help="largest acceptable mean relative deviation")
    p.add_argument("--deepspeed", default=None, help="also a 2-process run with this TrainingArguments.deepspeed "
                   "JSON (e.g. examples/configs/zero2.json)")
    p.add_argument("--gpu", action="store_true", help="run on GPUs (default: the CPU)")
    args = p.parse_args(own)
    out = Path(args.output_dir)
    recipe = ["--max_steps", str(args.max_steps), "--batch_size", str(args.batch_size), "--logging_steps",
              str(args.logging_steps), "--eval_steps", str(args.max_steps), "--disable_tqdm",
              *([] if args.gpu else ["--cpu"]), *extra]
    runs = {f"1 process, batch {args.batch_size}": launch("single", 1, out, recipe, [], cpu=not args.gpu),
            f"2-process FSDP, batch {2 * args.batch_size}": launch("fsdp", 2, out, recipe, ["--fsdp", args.fsdp],
                                                                  cpu=not args.gpu)}
    if args.deepspeed:
        runs[f"2-process DeepSpeed, batch {2 * args.batch_size}"] = launch(
            "deepspeed", 2, out, recipe, ["--deepspeed", str(Path(args.deepspeed).resolve())], cpu=not args.gpu)

    # the comparison itself is `impel compare` (impel/commands/compare.py): aligned on samples seen, because the
    # FSDP run's global batch is twice the single process's
    from impel.commands.main import main as impel

    names = [arg for name in runs for arg in ("--name", name)]
    return impel(["compare", *map(str, runs.values()), *names, "--align", "samples", "--tolerance",
                  str(args.tolerance), "--plot", str(out / "compare.png")])


if __name__ == "__main__":
    sys.exit(main())
