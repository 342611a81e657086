"""Train 3 steps under whatever the launch says, save_state to argv[1], and (rank 0) save the full state dict to
argv[2] with torch.save, for comparison with `impel merge-weights`."""
import sys

import torch
from torch import nn

from impel import Accelerator

acc = Accelerator()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 24), nn.Tanh(), nn.Linear(24, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
for step in range(3):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 10 + acc.process_index))
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
acc.save_state(sys.argv[1])
state = acc.get_state_dict(model)
if acc.is_main_process:
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, sys.argv[2])
acc.end_training()
