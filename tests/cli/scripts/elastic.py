"""A small run that checkpoints every 2 optimizer steps, for elastic jobs (``impel launch --nnodes 1:2``).

    elastic.py PROJECT_DIR TOTAL_STEPS [--accumulation N] [--seeded_loader]

The data is shuffled by the DataLoader's own generator with --seeded_loader, else by the one impel gives the sampler.

$ELASTIC_DIE_AT=N (set for one machine only): on its first attempt, that machine's rank SIGKILLs its agent (the
``impel launch`` process, its parent) and then itself after optimizer step N: the machine is lost.
$ELASTIC_FREEZE_AT=N: the same, with SIGSTOP: the machine is frozen (its processes and connections stay).
$ELASTIC_GROW_AT=N: a rank running alone (world size 1) after optimizer step N writes PROJECT_DIR/../alone and waits
(up to 120 s) for the SIGTERM its agent sends when a machine joins again; then impel saves and the job restarts on
both machines.
Every rank appends its pid to PROJECT_DIR/../pids (the test checks none is left running) and rank 0 prints its
final parameters and world size as a REPORT line.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from impel import Accelerator, ProjectConfiguration

p = argparse.ArgumentParser()
p.add_argument("project_dir")
p.add_argument("total", type=int)
p.add_argument("--accumulation", type=int, default=1)
p.add_argument("--seeded_loader", action="store_true")
args = p.parse_args()
die_at = int(os.environ.get("ELASTIC_DIE_AT", "0"))
freeze_at = int(os.environ.get("ELASTIC_FREEZE_AT", "0"))
grow_at = int(os.environ.get("ELASTIC_GROW_AT", "0"))
home = os.path.dirname(os.path.abspath(args.project_dir))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
with open(os.path.join(home, "pids"), "a") as f:
    f.write(f"{os.getpid()}\n")

acc = Accelerator(gradient_accumulation_steps=args.accumulation, project_config=ProjectConfiguration(
    args.project_dir, automatic_checkpoint_naming=True, total_limit=2, automatic_resume=True))
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 6, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True).tanh())
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(data, batch_size=4, shuffle=True,
                    generator=torch.Generator().manual_seed(1) if args.seeded_loader else None)
model, opt, loader = acc.prepare(model, opt, loader)
sigterm_seen = []
if grow_at and acc.num_processes == 1:
    impel_handler = signal.getsignal(signal.SIGTERM)

    def _seen(signum, frame):
        sigterm_seen.append(signum)
        impel_handler(signum, frame)

    signal.signal(signal.SIGTERM, _seen)
while opt.steps_taken < args.total:
    for bx, by in loader:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(bx), by))
            opt.step()
            opt.zero_grad()
        if not acc.sync_gradients:
            continue
        done = opt.steps_taken
        if done % 2 == 0:
            acc.save_state()
        if first_attempt and done == die_at:
            time.sleep(1)  # the other machine is in its next step's all-reduce when this one disappears
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and done == freeze_at:
            time.sleep(1)
            os.kill(os.getppid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        if grow_at and done == grow_at and acc.num_processes == 1:
            open(os.path.join(home, "alone"), "w").close()
            deadline = time.monotonic() + 120
            while not sigterm_seen and time.monotonic() < deadline:
                time.sleep(0.05)
        if done >= args.total:
            break
state = acc.get_state_dict(model)
if acc.is_main_process:
    sys.stdout.write("REPORT " + json.dumps({"world": acc.num_processes, "steps": opt.steps_taken,
                                             "accumulation": acc.gradient_accumulation_steps,
                                             "params": {k: v.flatten().tolist() for k, v in state.items()}}) + "\n")
    sys.stdout.flush()
acc.end_training()
