"""The seed exercise's check: the same recipe on 1 process and on 2-process FSDP gives a similar loss curve.

Runs ``examples/train_genre_classifier.py`` twice through ``impel launch``, changing nothing but the number of
processes and one TrainingArguments knob (``--fsdp "full_shard auto_wrap"``): same per-device batch, steps and
learning rate, so the FSDP run trains on twice the effective batch. Then it reads both runs' ``metrics.jsonl``,
prints how far the train-loss curves are apart at the logged steps (mean and largest absolute difference, and the
mean relative to the single-process loss), the final eval numbers of both, and draws both curves in one PNG.

Run it::

    python examples/compare_runs.py                         # 40 steps each, results under runs/compare
    python examples/compare_runs.py --max_steps 80 --tolerance 0.05 -- --lines_per_passage 8

Arguments after ``--`` go to the training script. Exit code 0 when the mean relative deviation is within
``--tolerance``, 1 otherwise.
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


def deviation(a: list[dict], b: list[dict]) -> dict[str, float]:
    """Train-loss differences at the steps both runs logged."""
    from impel.trainer.plot import series

    first, second = dict(zip(*series(a, "loss"))), dict(zip(*series(b, "loss")))
    steps = sorted(set(first) & set(second))
    if not steps:
        raise SystemExit("the two runs logged no common steps; use the same --logging_steps")
    diffs = [abs(first[s] - second[s]) for s in steps]
    mean_loss = sum(first[s] for s in steps) / len(steps)
    return {"steps": len(steps), "mean_abs": sum(diffs) / len(diffs), "max_abs": max(diffs),
            "mean_relative": sum(diffs) / len(diffs) / mean_loss}


def last_eval(history: list[dict]) -> str:
    rows = [r for r in history if "eval_loss" in r]
    if not rows:
        return "no evaluation"
    row = rows[-1]
    return f"eval_loss={row['eval_loss']:.4f}" + (f" eval_accuracy={row['eval_accuracy']:.4f}"
                                                  if "eval_accuracy" in row else "")


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
    p.add_argument("--gpu", action="store_true", help="run on GPUs (default: the CPU)")
    args = p.parse_args(own)
    out = Path(args.output_dir)
    recipe = ["--max_steps", str(args.max_steps), "--batch_size", str(args.batch_size), "--logging_steps",
              str(args.logging_steps), "--eval_steps", str(args.max_steps), "--disable_tqdm", *extra]
    single = launch("single", 1, out, recipe, [], cpu=not args.gpu)
    fsdp = launch("fsdp", 2, out, recipe, ["--fsdp", args.fsdp], cpu=not args.gpu)

    from impel.trainer.plot import plot_runs, read_history

    a, b = read_history(single), read_history(fsdp)
    dev = deviation(a, b)
    picture = plot_runs({f"1 process, batch {args.batch_size}": a,
                         f"2-process FSDP, batch {2 * args.batch_size}": b}, out / "compare.png",
                        title="same recipe: 1 process vs 2-process FSDP (effective batch doubled)")
    verdict = "similar" if dev["mean_relative"] <= args.tolerance else "NOT similar"
    print(f"train-loss deviation over {dev['steps']} logged steps: mean |diff| {dev['mean_abs']:.4f}, "
          f"max |diff| {dev['max_abs']:.4f}, mean relative {dev['mean_relative']:.1%} "
          f"(tolerance {args.tolerance:.0%}): {verdict}")
    print(f"single: {last_eval(a)} | fsdp: {last_eval(b)}")
    print(f"picture: {picture}")
    return 0 if verdict == "similar" else 1


if __name__ == "__main__":
    sys.exit(main())
