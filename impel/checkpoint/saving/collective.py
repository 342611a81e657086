"""Cross-rank agreement for save_state / load_state, which every rank must call.

Before touching a collective, each rank checks in on the process group's key-value store (the TCPStore torchrun
or ``init_process_group`` created) and waits, bounded by the process-group timeout, until all ranks have checked
in. A call made on one rank only (``if accelerator.is_main_process: accelerator.save_state()``) therefore raises a
clear error on the ranks that made it instead of hanging inside a barrier. Errors raised on one rank while
writing are shared, so every rank raises instead of some waiting forever for the others.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from impel.checkpoint.store.layout import CheckpointError
from impel.runtime.ranks.collectives import is_distributed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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
    values: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise CheckpointError(f"ranks disagree on {what} ({listed}); pass the same value on every rank")


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, str | None]:
    """``fn()``'s result, or its exception and that exception as one line for the other ranks."""
    try:
        return fn(), None, None
    except Exception as exc:  # noqa: BLE001 - re-raised by the caller on this rank, reported on the others
        return None, exc, f"{type(exc).__name__}: {exc}"


def _raise_others(messages: list[str | None], what: str) -> None:
    """A CheckpointError naming every rank whose step failed (its message), when any did."""
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    if failed:
        listed = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointError(f"{what} failed on another rank ({listed})")


def run_shared(fn: Callable[[], T], what: str, group: ProcessGroup | None = None) -> T:
    """Run ``fn`` on every rank; if it raises anywhere, raise on every rank (the original error where it happened).
    ``group``: the process group to agree on (an asynchronous save's background group; default: the default one).

    One all-reduce of a failure flag when nothing failed; the messages are gathered only after a failure."""
    result, error, message = _attempt(fn)
    if is_distributed() and _any_failed(error is not None, group):
        messages: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
        if error is None:
            _raise_others(messages, what)
    if error is not None:
        raise error
    return result


def gather_shared(fn: Callable[[], T], what: str, group: ProcessGroup | None = None) -> list[T]:
    """:func:`run_shared` that also returns every rank's result (in rank order), in one all-gather."""
    result, error, message = _attempt(fn)
    if not is_distributed():
        if error is not None:
            raise error
        return [result]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (message, result), group=group)
    if error is not None:
        raise error
    _raise_others([m for m, _ in gathered], what)
    return [value for _, value in gathered]


def _any_failed(failed: bool, group: ProcessGroup | None) -> bool:
    """Collective: True on every rank when ``failed`` is True on any (one all-reduce, on the group's device)."""
    import torch

    device = dist.distributed_c10d._get_object_coll_device(group)  # where all_gather_object would put it
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def prepare_agreed(value: str, what_value: str, fn: Callable[[], T], what: str, leader: bool,
                   group: ProcessGroup | None = None, joining: str | None = None) -> T:
    """One collective for three steps: every rank passed the same ``value`` (else a CheckpointError naming each
    rank's, as :func:`agree`), ``fn`` ran on the leader(s) (a failure raised on every rank, as :func:`run_shared`),
    and every rank returns rank 0's result (as :func:`on_leader`). ``group``: as :func:`run_shared`'s. ``joining``:
    the CheckpointError's message when the collective itself fails (a rank that never joins it: the group's
    timeout), for a step that is the first collective of a call, as an asynchronous save's background job's."""
    result: Any
    result, error, message = _attempt(fn) if leader else (None, None, None)
    if not is_distributed():
        if error is not None:
            raise error
        return result
    gathered: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(gathered, (value, result, message), group=group)
    except RuntimeError as exc:
        if joining is None:
            raise
        raise CheckpointError(f"{joining} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
    if len({g[0] for g in gathered}) > 1:
        listed = ", ".join(f"rank {r}: {g[0]!r}" for r, g in enumerate(gathered))
        raise CheckpointError(f"ranks disagree on {what_value} ({listed}); pass the same value on every rank")
    if error is not None:
        raise error
    _raise_others([g[2] for g in gathered], what)
    return gathered[0][1]


def on_leader(fn: Callable[[], T], what: str, leader: bool) -> T | None:
    """Run ``fn`` on the leader rank(s) only, and share its failure with every rank; returns rank 0's result."""
    return broadcast(run_shared(functools.partial(_if_leader, fn, leader), what))


def _if_leader(fn: Callable[[], T], leader: bool) -> T | None:
    return fn() if leader else None


def barrier() -> None:
    if is_distributed():
        dist.barrier()
