"""A short training run through the Accelerator; every rank prints its final parameters' checksum and how far
they are from a single-process loop over the same global batches."""
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from impel import Accelerator

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
acc = Accelerator()
g = torch.Generator().manual_seed(0)
x = torch.randn(8 * acc.num_processes * steps, 5, generator=g)
data = TensorDataset(x, x.sum(1, keepdim=True).sin())


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 1))


reference = build()
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for bx, by in DataLoader(data, batch_size=8 * acc.num_processes):
    nn.functional.mse_loss(reference(bx), by).backward()
    ref_opt.step()
    ref_opt.zero_grad()

model = build()
model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8))
losses = []
for bx, by in loader:
    loss = nn.functional.mse_loss(model(bx), by)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(acc.reduce(loss.detach(), reduction="mean").item())
final = acc.get_state_dict(model)
diff = max((final[k] - v).abs().max().item() for k, v in reference.state_dict().items())
checksum = sum(float(v.double().sum()) for v in final.values())
line = json.dumps({"rank": acc.process_index, "world": acc.num_processes, "checksum": checksum, "diff": diff,
                   "losses": losses, "distributed_type": str(acc.distributed_type)})
sys.stdout.write(f"REPORT {line}\n")  # one write: ranks share the pipe
sys.stdout.flush()
acc.end_training()
