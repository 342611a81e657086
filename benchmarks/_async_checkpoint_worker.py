"""One rank of the asynchronous-checkpoint benchmark (checkpoint.py's async rows), started by ``impel launch``.

Builds the ~106M-parameter GPT-2 of the memory benchmark with AdamW, takes an optimizer step, then alternates
synchronous and asynchronous ``save_state`` of the same state (REPEATS synchronous ones, each followed by CALLS
asynchronous ones, after one warm-up save of each kind that pays one-time imports, the background group and the
staging buffers). Reported per rank: the time the
training loop is blocked by each kind of save (the call; for a synchronous save the whole write), and for the
asynchronous one the time from the call to the commit (``wait_for_checkpoint`` right after the call: the
background write alone), each next to the disk's fsynced bandwidth rank 0 measured just before, and one copy of the
rank's state into buffers allocated once, started as the saves are (after a pause, all ranks together).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import _common
import torch
from _memory_worker import build, dir_bytes

from impel import Accelerator

REPEATS = 3
CALLS = 3  # asynchronous saves after each synchronous one, each just after a copy of the state


def main() -> None:
    n_layer, checkpoint_dir = int(sys.argv[1]), sys.argv[2]
    acc = Accelerator()
    model = build(n_layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(acc.process_index))
    acc.backward(model(input_ids=x.to(acc.device), labels=x.to(acc.device)).loss)
    opt.step()
    opt.zero_grad()
    out: dict = {"rank": acc.process_index, "params": sum(p.numel() for p in model.parameters()),  # DTensor: global
                 "sync_s": [], "blocked_s": [], "background_s": [], "disk_Bps": [], "copy_s": []}
    state = _common.rank_state(model, opt)
    buffers = {k: torch.empty_like(v) for k, v in state.items()}  # allocated once, as the stager's are

    def copy_once() -> float:  # the floor of an asynchronous save: one copy of the rank's state in memory
        # started as a save is (from an idle machine, every rank at once: the ranks share the memory bus)
        _common.pause()
        acc.wait_for_everyone()
        t0 = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        return time.perf_counter() - t0

    copy_once()
    previous: list[str] = []

    def fresh(name: str) -> str:
        acc.wait_for_everyone()
        if acc.is_main_process:
            for old in previous:
                shutil.rmtree(old, ignore_errors=True)  # outside the timing; keeps the disk from filling up
        previous[:] = []
        acc.wait_for_everyone()
        return f"{checkpoint_dir}-{name}"

    def save(target: str, asynchronous: bool) -> tuple[float, float]:
        _common.pause()  # as the disk measurement: from an idle machine (see _common.PAUSE_S)
        acc.wait_for_everyone()
        t0 = time.perf_counter()
        acc.save_state(target, async_save=asynchronous)
        blocked = time.perf_counter() - t0
        acc.wait_for_checkpoint()
        done = time.perf_counter() - t0
        previous.append(target)
        return blocked, done

    warm_sync = save(fresh("warm-sync"), False)[0]
    out["checkpoint_bytes"] = dir_bytes(previous[0])
    out["first_async_blocked_s"] = save(fresh("warm-async"), True)[0]
    out["warm_sync_s"] = warm_sync
    for rep in range(REPEATS):
        target = fresh(f"sync-{rep}")
        if acc.is_main_process:
            out["disk_Bps"].append(_common.disk_write_bandwidth(os.path.dirname(checkpoint_dir),
                                                                out["checkpoint_bytes"]))
        acc.wait_for_everyone()
        out["sync_s"].append(save(target, False)[1])
        for call in range(CALLS):  # a call and its floor are a few ms, each draw noisy: more of them than of saves
            out["copy_s"].append(copy_once())
            blocked, done = save(fresh(f"async-{rep}-{call}"), True)
            out["blocked_s"].append(blocked)
            if call == 0:  # the write next to the disk's measurement
                out["background_s"].append(done)
    fresh("end")
    sys.stdout.write("REPORT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    acc.end_training()


if __name__ == "__main__":
    main()
