"""One rank of the memory / checkpoint benchmark, started by ``impel launch`` (see memory.py and checkpoint.py).

Builds a ~100M-parameter GPT-2 after the Accelerator (so ZeRO-3 / RAM-efficient loading could partition at
construction), prepares it with AdamW, takes one optimizer step, and reports the tensor bytes this rank holds
(every distinct CPU storage reachable from Python objects: parameters, gradients, optimizer states, buffers),
the peak RSS, and optionally save_state / load_state times against the disk's bandwidth (measure_checkpoints).
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import time
from typing import Any

import _common
import torch

from impel import Accelerator

REPEATS = 5  # saves timed per format: the disk swings between measurements on a VM; a median of 5 pairs


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


def timed(acc: Accelerator, fn: Any) -> float:
    acc.wait_for_everyone()
    t0 = time.perf_counter()
    fn()
    acc.wait_for_everyone()
    return time.perf_counter() - t0


def measure_checkpoints(acc: Accelerator, checkpoint_dir: str, out: dict[str, Any], model: Any,
                        optimizer: Any) -> None:
    """A first save (it pays one-time imports), then REPEATS saves, each between two measurements rank 0 made of
    the disk's fsynced write bandwidth for a file of the checkpoint's size (REPEATS + 1 measurements: the disk
    drifts, so a save is compared with its two neighbours), every one after a pause (``_common.PAUSE_S``: the disk
    measurements and the saves all start from an idle machine), then a load of the last one (from the page
    cache), a cold load of it (its pages dropped first: every check reads from disk) and a cold ``torch.load`` of
    the same state."""
    first = checkpoint_dir + "-first"
    out["first_save_s"] = timed(acc, lambda: acc.save_state(first))
    out["checkpoint_bytes"] = dir_bytes(first)
    out["save_s"], out["disk_Bps"] = [], []
    previous = first
    for rep in range(REPEATS):
        if acc.is_main_process:
            shutil.rmtree(previous)  # outside the timing; keeps the disk from filling up
            out["disk_Bps"].append(_common.disk_write_bandwidth(os.path.dirname(checkpoint_dir),
                                                                out["checkpoint_bytes"]))
        previous = f"{checkpoint_dir}-{rep}"
        _common.pause()  # every rank: a save inside training comes after steps, not after another large write
        out["save_s"].append(timed(acc, lambda target=previous: acc.save_state(target)))
    if acc.is_main_process:  # the last save's second neighbour
        out["disk_Bps"].append(_common.disk_write_bandwidth(os.path.dirname(checkpoint_dir), out["checkpoint_bytes"]))
    acc.wait_for_everyone()
    out["load_s"] = timed(acc, lambda: acc.load_state(previous))
    if acc.is_main_process:
        _common.evict(previous)
    _common.pause()  # as before a save: the cold loads, ours and torch.load, both start from an idle machine
    out["cold_load_s"] = timed(acc, lambda: acc.load_state(previous))
    # the reference: torch.load of the same bytes, cold: a sharded checkpoint's ranks read their own shards (one
    # file per rank), a full checkpoint's ranks each read the whole state (one file, every rank reads it)
    meta = os.path.join(previous, "impel_checkpoint.json")  # absent in Accelerate's checkpoints: full files
    per_rank = False
    if os.path.isfile(meta):
        with open(meta) as f:
            per_rank = json.load(f)["strategy"].get("format") == "sharded"
    state = reference_state(model, optimizer, full=not per_rank)
    reference = f"{checkpoint_dir}-torch-{acc.process_index if per_rank else 0}.pt"
    if per_rank or acc.is_main_process:
        torch.save(state, reference)
        _common.evict(reference)
    acc.wait_for_everyone()
    out["torch_bytes"] = os.path.getsize(reference)
    _common.pause()
    out["cold_torch_load_s"] = timed(acc, lambda: torch.load(reference, weights_only=True, map_location="cpu"))
    acc.wait_for_everyone()
    if per_rank or acc.is_main_process:
        os.unlink(reference)


def reference_state(model: Any, optimizer: Any, full: bool) -> dict[str, torch.Tensor]:
    """Plain tensors by name: this rank's shards, or (``full``) the whole model and optimizer state."""
    if not full:
        return {k: v.clone() for k, v in _common.rank_state(model, optimizer).items()}
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)  # collective under FSDP; every rank gets the whole state
    inner = getattr(optimizer, "optimizer", optimizer)
    out = {f"model/{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    for name, entries in get_optimizer_state_dict(model, inner, options=options)["state"].items():
        out.update({f"optimizer/{name}/{k}": v for k, v in entries.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().clone() for k, v in out.items()}


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
        measure_checkpoints(acc, checkpoint_dir, out, model, opt)
    sys.stdout.write("REPORT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    acc.end_training()


if __name__ == "__main__":
    main()
