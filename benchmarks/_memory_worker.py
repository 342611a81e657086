"""One rank of the memory / checkpoint benchmark, started by ``impel launch`` (see memory.py and checkpoint.py).

Builds a ~100M-parameter GPT-2 after the Accelerator (so ZeRO-3 / RAM-efficient loading could partition at
construction), prepares it with AdamW, takes one optimizer step, and reports the tensor bytes this rank holds
(every distinct CPU storage reachable from Python objects: parameters, gradients, optimizer states, buffers),
the peak RSS, and optionally the time to save_state (a first and a second save) / load_state and the checkpoint's
size on disk.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time

import torch

from impel import Accelerator


def tensor_bytes() -> int:
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or type(obj).__name__ == "DTensor" or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # noqa: BLE001 - exotic tensor subclasses without a plain storage are skipped
            continue
        if ptr and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
    return total


def build(n_layer: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=8192, n_positions=256))


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    n_layer = int(sys.argv[1])
    checkpoint_dir = sys.argv[2] if len(sys.argv) > 2 else None
    acc = Accelerator()
    base = tensor_bytes()
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (import before zero.Init patches torch.Tensor)

    with acc.init_context():  # ZeRO-3 partitions at construction; other strategies build normally
        model = build(n_layer)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: partitioned
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=2)
    model, opt, _ = acc.prepare(model, opt, loader)  # DeepSpeed sizes its batch from the prepared dataloader
    after_prepare = tensor_bytes() - base
    x = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(acc.process_index))
    acc.backward(model(input_ids=x.to(acc.device), labels=x.to(acc.device)).loss)
    opt.step()
    after_step = tensor_bytes() - base
    opt.zero_grad()
    out = {"rank": acc.process_index, "world": acc.num_processes, "params": n_params,
           "bytes_after_prepare": after_prepare, "bytes_after_step": after_step,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "strategy": str(acc.distributed_type)}
    if checkpoint_dir:
        for key, target in (("first_save_s", checkpoint_dir + "-first"), ("save_s", checkpoint_dir)):
            acc.wait_for_everyone()  # the first save pays one-time imports; a training run saves many times
            t0 = time.perf_counter()
            acc.save_state(target)
            acc.wait_for_everyone()
            out[key] = time.perf_counter() - t0
        out["checkpoint_bytes"] = dir_bytes(checkpoint_dir)
        t0 = time.perf_counter()
        acc.load_state(checkpoint_dir)
        acc.wait_for_everyone()
        out["load_s"] = time.perf_counter() - t0
    sys.stdout.write("REPORT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    acc.end_training()


if __name__ == "__main__":
    main()
