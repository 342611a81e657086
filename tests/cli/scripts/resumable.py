"""A training run that checkpoints every 2 optimizer steps and can be interrupted on purpose.

    resumable.py PROJECT_DIR TOTAL_STEPS [--kill_at N] [--sigterm_at N] [--nonfinite_at N]

--kill_at N: on the first attempt, rank 1 SIGKILLs itself right after optimizer step N (a crash).
--sigterm_at N: rank 0 sends SIGTERM to its launcher after step N (a preemption: the launcher or torchrun's agent
passes it on to every rank).
--nonfinite_at N: the loss of micro-step N is NaN on rank 0.
Every rank prints its final parameters' sha256 (bitwise identity across runs) as a REPORT line.
"""
import argparse
import hashlib
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
p.add_argument("--kill_at", type=int, default=None)
p.add_argument("--sigterm_at", type=int, default=None)
p.add_argument("--nonfinite_at", type=int, default=None)
args = p.parse_args()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

acc = Accelerator(gradient_accumulation_steps=2, project_config=ProjectConfiguration(
    args.project_dir, automatic_checkpoint_naming=True, total_limit=3))
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 6, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True).tanh())
model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
model, opt, loader, sched = acc.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True), sched)
# The signal travels launcher -> torchrun's agent -> ranks; on a busy machine that can take longer than the rest of the
# run. Rank 0 waits until it has arrived (chained before impel's own handler), so the preemption lands at a known step.
sigterm_seen = []
if args.sigterm_at is not None:
    impel_handler = signal.getsignal(signal.SIGTERM)

    def _seen(signum, frame):
        sigterm_seen.append(signum)
        if callable(impel_handler):
            impel_handler(signum, frame)

    signal.signal(signal.SIGTERM, _seen)
micro = 0
while opt.steps_taken < args.total:
    for bx, by in loader:
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(bx), by)
            micro += 1
            if micro == args.nonfinite_at and acc.process_index == 0:
                loss = loss * float("nan")
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if not acc.sync_gradients or opt.step_was_skipped:
            continue
        done = opt.steps_taken
        if done % 2 == 0:
            acc.save_state()
        if first_attempt and done == args.kill_at and acc.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if done == args.sigterm_at and acc.process_index == 0:
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 120
            while not sigterm_seen and time.monotonic() < deadline:
                time.sleep(0.01)
        if done >= args.total:
            break
state = acc.get_state_dict(model)
digest = hashlib.sha256(b"".join(v.cpu().contiguous().numpy().tobytes() for v in state.values())).hexdigest()
sys.stdout.write("REPORT " + json.dumps({"rank": acc.process_index, "sha": digest, "steps": opt.steps_taken,
                                         "first_attempt": first_attempt}) + "\n")
sys.stdout.flush()
acc.end_training()
