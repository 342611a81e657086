"""Cross-rank operations on tensors and nested containers, built on torch.distributed (no home-made collectives).

Every function is a no-op copy on one process, so a loop calls them unconditionally.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group of more than one rank exists: the one test of "do collectives run?"."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def recursively_apply(fn: Callable[[torch.Tensor], Any], data: Any, error_on_other_type: bool = True) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples, namedtuples and mappings; other leaves raise, or with
    ``error_on_other_type=False`` are returned unchanged."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        items = [recursively_apply(fn, d, error_on_other_type) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        out = {k: recursively_apply(fn, v, error_on_other_type) for k, v in data.items()}
        rebuild: Callable[..., Any] = type(data)  # the concrete mapping class (dict, BatchEncoding, ...)
        try:
            return rebuild(out)
        except TypeError:
            return out
    if not error_on_other_type:
        return data
    raise TypeError(f"cannot apply a collective to {type(data).__name__}; pass tensors or lists/tuples/dicts of "
                    "tensors (use gather_object for other Python objects)")


SELF = "self"  # a ``group`` of this process alone (a data-parallel group of one: tensor parallelism only)


def _size(group: Any) -> int:
    """Members of ``group`` (None: every rank) taking part in a collective; 1 means none runs."""
    if group == SELF or not is_distributed():
        return 1
    return dist.get_world_size(group)


def _gather_one(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    size = _size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return torch.cat(out, dim=0)


def gather(data: Any, group: Any = None) -> Any:
    """Concatenate each tensor across ranks along dim 0 (0-d tensors become 1-d); shapes must match. ``group``: a
    process group (default every rank) or :data:`SELF`."""
    if _size(group) > 1:
        _check_same_shapes(data, group)
    return recursively_apply(lambda t: _gather_one(t, group), data)


def _check_same_shapes(data: Any, group: Any = None) -> None:
    """One tiny all_gather of a shape fingerprint; the detailed (pickled) exchange only when they differ."""
    shapes: list[Any] = []
    recursively_apply(lambda t: shapes.append(tuple(t.shape)), data)
    mine = torch.tensor([hash(tuple(shapes)) & (2**62 - 1)], dtype=torch.int64)
    prints = [torch.empty_like(mine) for _ in range(_size(group))]
    dist.all_gather(prints, mine, group=group)
    if all(torch.equal(p, mine) for p in prints):
        return
    everyone: list[Any] = [None] * _size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    raise ValueError(f"gather needs the same shapes on every rank, got {everyone}; call "
                     "pad_across_processes first")


def gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Gather picklable objects; lists are flattened one level (as Accelerate does)."""
    if _size(group) == 1:
        return list(obj) if isinstance(obj, list) else [obj]
    out: list[Any] = [None] * _size(group)
    dist.all_gather_object(out, obj, group=group)
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out


def reduce(data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum (or average) tensors across ranks; ``reduction`` is 'sum', 'mean' or 'none'."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'sum', 'mean' or 'none'")

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if is_distributed() and reduction != "none":
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                t = t / dist.get_world_size()
        return t * scale if scale != 1.0 else t

    return recursively_apply(one, data)


def broadcast(data: Any, from_process: int = 0) -> Any:
    """Tensors are broadcast in place; other objects are sent pickled. Returns the received value."""
    if not is_distributed():
        return data
    try:
        return recursively_apply(lambda t: (dist.broadcast(t, src=from_process), t)[1], data)
    except TypeError:
        box = [data]
        dist.broadcast_object_list(box, src=from_process)
        return box[0]


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    if is_distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size any rank holds, so it can be gathered."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if not is_distributed() or t.ndim == 0 or dim >= t.ndim:
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, size)
        target = int(max(s.item() for s in sizes))
        if target == t.shape[dim]:
            return t
        new_shape = list(t.shape)
        new_shape[dim] = target
        out = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        index[dim] = slice(target - t.shape[dim], target) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    return recursively_apply(one, data)


def truncate(data: Any, length: int) -> Any:
    """Keep the first ``length`` rows of each gathered tensor (drops even-batches padding)."""
    return recursively_apply(lambda t: t[:length], data)


def wait_for_everyone() -> None:
    """A barrier across every rank of the default process group (a no-op on one process)."""
    if is_distributed():
        dist.barrier()


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside dicts, lists, tuples, namedtuples and ``.to``-able objects to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        moved = [send_to_device(o, device, non_blocking) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, Mapping):
        moved_map = {k: send_to_device(v, device, non_blocking) for k, v in obj.items()}
        rebuild: Callable[..., Any] = type(obj)  # the concrete mapping class (dict, BatchEncoding, ...)
        try:
            return rebuild(moved_map)
        except TypeError:
            return moved_map
    to = getattr(obj, "to", None)
    if callable(to):
        try:
            return to(device)
        except TypeError:
            return obj
    return obj
