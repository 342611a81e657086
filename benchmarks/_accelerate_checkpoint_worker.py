"""One rank of the checkpoint benchmark's Accelerate row (checkpoint.py), started by ``accelerate launch``.

The same ~100M-parameter GPT-2 + AdamW as ``_memory_worker``, prepared by Accelerate 1.15's own ``Accelerator``
(DDP on CPU ranks), one optimizer step, then the same timings of its ``save_state`` / ``load_state``
(``_memory_worker.measure_checkpoints``): saves against the disk measured around each, a cold load against a
cold ``torch.load`` of the same bytes. Accelerate neither fsyncs its files nor verifies them when loading.
"""
from __future__ import annotations

import json
import sys

import _common  # noqa: F401  (first: one thread per rank)
import torch
from _memory_worker import build, measure_checkpoints


def main() -> None:
    from accelerate import Accelerator

    n_layer, checkpoint_dir = int(sys.argv[1]), sys.argv[2]
    acc = Accelerator(cpu=True)
    model = build(n_layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(acc.process_index))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()
    out: dict = {"rank": acc.process_index, "params": sum(p.numel() for p in model.parameters())}
    measure_checkpoints(acc, checkpoint_dir, out, model, opt)
    sys.stdout.write("REPORT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    acc.end_training()


if __name__ == "__main__":
    main()
