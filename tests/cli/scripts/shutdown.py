"""Reports whether the process group still exists when the interpreter exits. argv[1]: "end_training" calls
Accelerator.end_training(); "implicit" just returns."""
import atexit
import json
import sys

import torch
import torch.distributed as dist


def emit(row: dict) -> None:
    sys.stdout.write("REPORT " + json.dumps(row) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()


def report() -> None:  # registered before impel's own handler, so it runs after it (atexit is LIFO)
    emit({"rank": rank, "group_alive": dist.is_initialized()})


atexit.register(report)
from impel import Accelerator  # noqa: E402

acc = Accelerator()
rank = acc.process_index
total = acc.reduce(torch.tensor([rank + 1.0])).item()
assert total == 3.0, total
mode = sys.argv[1]
if mode == "end_training":
    acc.end_training()
    emit({"rank": rank, "after_end_training": dist.is_initialized()})
