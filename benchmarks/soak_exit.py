"""Soak the exit path: launch a finished 2-rank FSDP2 job N times and count how many exit 0.

The job is the smallest one that showed the rare SIGABRT at exit (impel/runtime/ranks/teardown.py): FSDP2 over gloo
on 2 CPU
ranks, a few AdamW steps, ``save_state``, a ``gather_for_metrics`` evaluation, then either ``end_training()`` or
a plain return (impel's exit handler does the teardown). Not part of ``make test`` or ``make bench``: it takes
N x (a few seconds), more under load. Run by hand, e.g. two at once to load both cores:

    python benchmarks/soak_exit.py -n 200
    python benchmarks/soak_exit.py -n 100 --mode end_training --jobs 2

Prints one line per failure (exit code and the last lines of its log, which keeps the run directory) and the
totals. Exit status 0 only when every launch exited 0.
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

JOB = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from impel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(3):
        acc.backward(model(torch.randn(8, 16)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    acc.save_state(sys.argv[2])
    preds = acc.gather_for_metrics(model(torch.randn(8, 16)).argmax(-1))
    print("rank", acc.process_index, "done", tuple(preds.shape), flush=True)
    if sys.argv[1] == "end_training":
        acc.end_training()
""")


def launch_once(index: int, mode: str, root: Path, timeout: float) -> tuple[int, int, str]:
    """One launch in its own directory; the directory is removed when the launch exited 0."""
    where = root / f"run{index:04d}-{mode}"
    where.mkdir()
    script = where / "job.py"
    script.write_text(JOB)
    cmd = [sys.executable, "-m", "impel.commands.main", "launch", "--cpu", "--num_processes", "2", "--use_fsdp",
           str(script), mode, str(where / "ckpt")]
    try:
        res = subprocess.run(cmd, cwd=where, capture_output=True, text=True, timeout=timeout)
        code, output = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    if code == 0:
        shutil.rmtree(where, ignore_errors=True)
    else:
        (where / "log.txt").write_text(output)
    return index, code, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="launches (default 200)")
    parser.add_argument("--mode", choices=["implicit", "end_training", "both"], default="both",
                        help="how the job ends; 'both' alternates (default)")
    parser.add_argument("--jobs", type=int, default=1, help="launches at once (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (default 300)")
    args = parser.parse_args()
    modes = ["implicit", "end_training"] if args.mode == "both" else [args.mode]
    root = Path(tempfile.mkdtemp(prefix="impel-soak-"))
    failures = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda im: launch_once(im[0], im[1], root, args.timeout),
                        zip(range(args.n), itertools.cycle(modes)))
        for done, (index, code, output) in enumerate(runs, 1):
            if code != 0:
                failures += 1
                tail = "\n    ".join(output.strip().splitlines()[-6:])
                print(f"launch {index}: exit {code} (kept in {root / f'run{index:04d}'}*)\n    {tail}", flush=True)
            if done % 25 == 0:
                print(f"... {done}/{args.n} launches, {done - failures} exited 0", flush=True)
    print(f"soak_exit: {args.n - failures}/{args.n} launches exited 0 (mode {args.mode}, {args.jobs} at once)")
    if failures == 0:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
