"""A synchronous save that meets a full disk on one rank of several (importable by spawned ranks)."""
from __future__ import annotations

import errno
import os
from typing import Any

import torch

from checkpoint_helpers import make_run, train


def full_disk_on_one_rank(root: str, failing_rank: int) -> dict[str, Any]:
    """Save, then save again to the same path while ``failing_rank``'s writes hit ENOSPC (FSDP: its own shard;
    DDP: rank 0 writes the model and optimizer, every rank its RNG state). Reports each rank's error and whether
    the first checkpoint still loads with the state it held."""
    from impel.checkpoint.io import digests

    acc, model, opt, loader, sched = make_run(None)
    train(acc, model, opt, loader, sched, 2)
    target = os.path.join(root, "ckpt")
    acc.save_state(target)
    saved = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    train(acc, model, opt, loader, sched, 4)
    real = digests._AppendingWriter.write

    def full(self: Any, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    if acc.process_index == failing_rank:
        digests._AppendingWriter.write = full  # type: ignore[method-assign]
    try:
        acc.save_state(target)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        digests._AppendingWriter.write = real  # type: ignore[method-assign]
    acc.wait_for_everyone()  # the leader has deleted its temporary directory by now
    listing = sorted(os.listdir(root))
    acc.load_state(target)
    loaded = acc.unwrap_model(model).state_dict()
    same = all(torch.equal(_local(loaded[k]), _local(saved[k])) for k in saved)
    acc.end_training()
    return {"error": error, "listing": listing, "same": same}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
