"""Reports, when the interpreter exits, whether the process group still exists and how many gloo worker threads
are left. argv[1]: "end_training" calls Accelerator.end_training(); "implicit" just returns. argv[2] (optional):
"model" prepares a small model and optimizer, trains one step and ends with gather_for_metrics, the way training
scripts end (launch with --use_fsdp for FSDP2, without for DDP)."""
import atexit
import json
import sys

import torch
import torch.distributed as dist

from impel.runtime.ranks.teardown import gloo_worker_threads


def emit(row: dict) -> None:
    sys.stdout.write("REPORT " + json.dumps(row) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()


def report() -> None:  # registered before impel's own handler, so it runs after it (atexit is LIFO)
    emit({"rank": rank, "group_alive": dist.is_initialized(), "gloo_threads": gloo_worker_threads()})


atexit.register(report)
from impel import Accelerator  # noqa: E402

acc = Accelerator()
rank = acc.process_index
total = acc.reduce(torch.tensor([rank + 1.0])).item()
assert total == 3.0, total
if sys.argv[2:] == ["model"]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    preds = acc.gather_for_metrics(model(torch.randn(4, 8)).argmax(-1))
    assert preds.shape == (8,), preds.shape
    emit({"rank": rank, "gloo_threads_while_training": gloo_worker_threads()})
mode = sys.argv[1]
if mode == "end_training":
    acc.end_training()
    emit({"rank": rank, "after_end_training": dist.is_initialized()})
