"""Cross-rank agreement for save_state / load_state, which every rank must call.

Before touching a collective, each rank checks in on the process group's key-value store (the TCPStore torchrun
or ``init_process_group`` created) and waits, bounded by the process-group timeout, until all ranks have checked
in. A call made on one rank only (``if accelerator.is_main_process: accelerator.save_state()``) therefore raises a
clear error on the ranks that made it instead of hanging inside a barrier. Errors raised on one rank while
writing are shared, so every rank raises instead of some waiting forever for the others.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from impel.checkpoint.layout import CheckpointError
from impel.runtime.collectives import is_distributed

T = TypeVar("T")


def arrive(op: str, timeout: timedelta) -> None:
    """Wait until every rank has entered ``op`` (e.g. ``"save_state"``); raise after ``timeout`` naming the absent."""
    if not is_distributed():
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    # this rank's call count lives in the group's own store: a new group starts at 0, and nothing is process-global
    seq = store.add(f"impel/checkpoint/{op}/calls/rank{rank}", 1) - 1
    key = f"impel/checkpoint/{op}/{seq}"
    store.set(f"{key}/rank{rank}", "1")
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
        return
    try:
        store.wait([f"{key}/all"], timeout)
    except Exception:  # noqa: BLE001 - DistStoreError / RuntimeError by torch version
        missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
        raise CheckpointError(
            f"{op}() was called on rank {rank} but rank(s) {missing} did not call it within {timeout}; {op}() is "
            f"collective: call it on every rank (not under `if accelerator.is_main_process:`), or raise the wait "
            "with InitProcessGroupKwargs(timeout=...)") from None


def broadcast(value: T, src: int = 0) -> T:
    """Rank ``src``'s picklable ``value`` on every rank (the value itself on one process)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def agree(value: str, what: str) -> None:
    """Raise on every rank when ranks passed different values (for example different output directories)."""
    if not is_distributed():
        return
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise CheckpointError(f"ranks disagree on {what} ({listed}); pass the same value on every rank")


def run_shared(fn: Callable[[], T], what: str, group: Any = None) -> T:
    """Run ``fn`` on every rank; if it raises anywhere, raise on every rank (the original error where it happened).
    ``group``: the process group to agree on (an asynchronous save's background group; default: the default one)."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below on this rank, reported on the others
        error = exc
    if is_distributed():
        messages: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = {r: m for r, m in enumerate(messages) if m is not None}
        if failed and error is None:
            listed = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
            raise CheckpointError(f"{what} failed on another rank ({listed})")
    if error is not None:
        raise error
    return result


def on_leader(fn: Callable[[], T], what: str, leader: bool) -> T | None:
    """Run ``fn`` on the leader rank(s) only, and share its failure with every rank; returns rank 0's result."""
    return broadcast(run_shared(lambda: fn() if leader else None, what))


def barrier() -> None:
    if is_distributed():
        dist.barrier()
