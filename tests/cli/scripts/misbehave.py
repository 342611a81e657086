"""A DDP training loop in which one rank misbehaves at step 3 (issue 27's launcher cases).

    misbehave.py PID_DIR exitN RANK     that rank calls sys.exit(N) while the others train on (exit0, exit3)
    misbehave.py PID_DIR stall RANK S   that rank sleeps S seconds while the others wait in the all-reduce
    misbehave.py PID_DIR forever        every rank trains until it is killed

Each rank writes its pid to PID_DIR/rank<N>.pid once training has started.
"""
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from impel import Accelerator

pid_dir, mode = Path(sys.argv[1]), sys.argv[2]
target = int(sys.argv[3]) if len(sys.argv) > 3 else -1
acc = Accelerator()
torch.manual_seed(0)
model = nn.Linear(4, 1)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
(pid_dir / f"rank{acc.process_index}.pid").write_text(str(os.getpid()))
step = 0
while mode == "forever" or step < 6:
    if step == 3 and acc.process_index == target:
        if mode.startswith("exit"):
            sys.exit(int(mode[4:]))
        if mode == "stall":
            time.sleep(float(sys.argv[4]))
    acc.backward(model(torch.randn(8, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    step += 1
    if mode == "forever":
        time.sleep(0.05)
print(f"rank {acc.process_index} done", flush=True)
