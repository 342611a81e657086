"""Cross-rank operations on tensors and nested containers, built on torch.distributed (no home-made collectives).

Every function is a no-op copy on one process, so a loop calls them unconditionally.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, TypeAlias, TypeVar, overload

import torch
import torch.distributed as dist

from impel.config import environment as env
from impel.runtime.ranks import rank_health

T = TypeVar("T")
# a process group, None (every rank) or :data:`SELF` (this process alone)
Group: TypeAlias = dist.ProcessGroup | Literal["self"] | None


def is_distributed() -> bool:
    """True when a process group of more than one rank exists: the one test of "do collectives run?"."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_torch_tensor(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor)


def recursively_apply(func: Callable[..., object], data: object, *args: object,
                      test_type: Callable[[Any], bool] = is_torch_tensor, error_on_other_type: bool = False,
                      **kwargs: object) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every leaf passing ``test_type`` (a tensor by default) in nested
    lists, tuples, namedtuples and mappings (Accelerate's signature); other leaves are returned unchanged, or with
    ``error_on_other_type=True`` raise a TypeError."""
    if isinstance(data, (list, tuple)):
        items = [recursively_apply(func, d, *args, test_type=test_type, error_on_other_type=error_on_other_type,
                                   **kwargs) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        out = {k: recursively_apply(func, v, *args, test_type=test_type, error_on_other_type=error_on_other_type,
                                    **kwargs) for k, v in data.items()}
        rebuild: Callable[..., object] = type(data)  # the concrete mapping class (dict, BatchEncoding, ...)
        try:
            return rebuild(out)
        except TypeError:
            return out
    if test_type(data):
        return func(data, *args, **kwargs)
    if not error_on_other_type:
        return data
    # Accelerate's sentence, word for word (code compares it): the leaf's type, the function, what to pass instead
    raise TypeError(f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
                    f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` "
                    "should be passed.")


def _tensors(fn: Callable[[torch.Tensor], torch.Tensor], data: T) -> T:
    """``recursively_apply`` for the collectives: every leaf must be a tensor, and stays one (so the result has
    ``data``'s type: the same containers, tensors in them)."""
    return recursively_apply(fn, data, error_on_other_type=True)


SELF: Final = "self"  # a ``group`` of this process alone (a data-parallel group of one: tensor parallelism only)


def _size(group: Group) -> int:
    """Members of ``group`` (None: every rank) taking part in a collective; 1 means none runs."""
    if group == SELF or not is_distributed():
        return 1
    return dist.get_world_size(group)


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` left a nested tensor unpadded (Accelerate's warning class)."""


class DistributedOperationException(Exception):
    """A collective cannot run as called: the tensors' shapes differ across ranks, or a tensor is on another device
    than the process's (Accelerate's exception of that name)."""


_DEBUG: dict[str, bool | None] = {"on": None}  # None: follow $ACCELERATE_DEBUG_MODE


def debug_mode() -> bool:
    """Whether collectives check shapes across ranks first (``state.debug``, else ``$ACCELERATE_DEBUG_MODE``)."""
    on = _DEBUG["on"]
    return bool(env.parse_flag_from_env("ACCELERATE_DEBUG_MODE")) if on is None else on


def set_debug_mode(on: bool | None) -> None:
    """Turn debug mode on or off for this process (None: follow ``$ACCELERATE_DEBUG_MODE`` again)."""
    _DEBUG["on"] = on


def _shapes(data: object) -> object:
    return recursively_apply(lambda t: list(t.shape), data)


def _verify(operation: str, data: object, group: Group = None, dims_only: bool = False) -> None:
    """Debug mode's check before ``operation``: the same (nested) shapes on every rank (with ``dims_only``, the same
    number of dimensions), else :class:`DistributedOperationException` listing each rank's."""
    if _size(group) == 1 or not debug_mode():
        return
    everyone: list[object] = [None] * _size(group)
    mine = recursively_apply(lambda t: t.ndim, data) if dims_only else _shapes(data)
    dist.all_gather_object(everyone, mine, group=group)
    if any(s != everyone[0] for s in everyone):
        listed = "\n  - ".join(f"Process {i}: {s}" for i, s in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid."
            f"\n\nOperation: `impel.utils.operations.{operation}`\nInput shapes:\n  - {listed}")


def _gather_one(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor[None]
    size = _size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return torch.cat(out, dim=0)


@rank_health.blocking("gather")
def gather(tensor: T, group: Group = None) -> T:
    """Concatenate each tensor across ranks along dim 0 (0-d tensors become 1-d); shapes must match (checked, a
    :class:`DistributedOperationException` naming each rank's shapes). ``group``: a process group (default every
    rank) or :data:`SELF`."""
    if _size(group) > 1:
        if debug_mode():  # debug mode's full exchange of shapes subsumes the fingerprint check: one collective
            _verify("gather", tensor, group)
        else:
            _check_same_shapes(tensor, group)
    return _tensors(lambda t: _gather_one(t, group), tensor)


def _check_same_shapes(data: object, group: Group = None) -> None:
    """One tiny all_gather of a shape fingerprint; the detailed (pickled) exchange only when they differ."""
    shapes: list[tuple[int, ...]] = []
    recursively_apply(lambda t: shapes.append(tuple(t.shape)), data, error_on_other_type=True)
    mine = torch.tensor([hash(tuple(shapes)) & (2**62 - 1)], dtype=torch.int64)
    prints = [torch.empty_like(mine) for _ in range(_size(group))]
    dist.all_gather(prints, mine, group=group)
    if all(torch.equal(p, mine) for p in prints):
        return
    everyone: list[object] = [None] * _size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    raise DistributedOperationException(f"gather needs the same shapes on every rank, got {everyone}; call "
                                        "pad_across_processes first")


@rank_health.blocking("gather_object")
def gather_object(object: T, group: Group = None) -> list[Any]:  # noqa: A002 (Accelerate's keyword)
    """Gather picklable objects; lists are flattened one level (as Accelerate does)."""
    if _size(group) == 1:
        return list(object) if isinstance(object, list) else [object]
    out: list[Any] = [None] * _size(group)
    dist.all_gather_object(out, object, group=group)
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


@rank_health.blocking("reduce")
def reduce(tensor: T, reduction: str = "mean", scale: float = 1.0) -> T:
    """Reduce each tensor across ranks: ``reduction`` 'mean' (the default, as Accelerate's), 'sum', 'max', 'min' or
    'none' (each rank keeps its own); the result is multiplied by ``scale``. The Accelerator's ``reduce`` defaults
    to 'sum', as Accelerate's."""
    if reduction not in (*_REDUCE_OPS, "none"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'mean', 'sum', 'max', 'min' or 'none'")
    _verify("reduce", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if is_distributed() and reduction != "none":
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]))
            if reduction == "mean":
                t = t / dist.get_world_size()
        return t * scale if scale != 1.0 else t

    return _tensors(one, tensor)


@rank_health.blocking("broadcast")
def broadcast(tensor: T, from_process: int = 0) -> T:
    """Tensors are broadcast in place; other objects are sent pickled. Returns the received value."""
    if not is_distributed():
        return tensor
    _verify("broadcast", tensor)
    try:
        return _tensors(lambda t: (dist.broadcast(t, src=from_process), t)[1], tensor)
    except TypeError:
        box = [tensor]
        dist.broadcast_object_list(box, src=from_process)
        return box[0]


@rank_health.blocking("broadcast_object_list")
def broadcast_object_list(object_list: list[T], from_process: int = 0) -> list[T]:
    if is_distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def pad_across_processes(tensor: T, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> T:
    """Pad each tensor along ``dim`` to the largest size any rank holds, so it can be gathered."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn("Cannot pad nested tensors without more information. Leaving unprocessed.",
                          CannotPadNestedTensorWarning, stacklevel=4)
            return t
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

    try:
        _verify("pad_across_processes", tensor, dims_only=True)
        return _tensors(one, tensor)
    except DistributedOperationException as error:
        raise DistributedOperationException("Error found while calling `impel.utils.operations."
                                            "pad_across_processes`. Please see the earlier error for more "
                                            "details.") from error


def truncate(data: T, length: int) -> T:
    """Keep the first ``length`` rows of each gathered tensor (drops even-batches padding)."""
    return _tensors(lambda t: t[:length], data)


@rank_health.blocking("wait_for_everyone")
def wait_for_everyone() -> None:
    """A barrier across every rank of the default process group (a no-op on one process)."""
    if is_distributed():
        dist.barrier()


@overload
def send_to_device(tensor: torch.Tensor, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | None = None) -> torch.Tensor: ...
@overload
def send_to_device(tensor: T, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | None = None) -> T: ...
def send_to_device(tensor: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | None = None) -> object:
    """Move every tensor inside dicts, lists, tuples, namedtuples and ``.to``-able objects to ``device``; the values
    of a mapping under ``skip_keys`` (a key or a list of keys) stay where they are."""
    cls = type(tensor)
    if cls is torch.Tensor or isinstance(tensor, torch.Tensor):
        return tensor if tensor.device == torch.device(device) else tensor.to(device, non_blocking=non_blocking)
    if cls is list or cls is tuple:  # every batch: tensors already in place cost no call each
        target = torch.device(device)
        return cls([o if type(o) is torch.Tensor and o.device == target
                    else send_to_device(o, device, non_blocking, skip_keys) for o in tensor])
    if isinstance(tensor, (list, tuple)):
        moved = [send_to_device(o, device, non_blocking, skip_keys) for o in tensor]
        return cls(*moved) if hasattr(tensor, "_fields") else cls(moved)
    if isinstance(tensor, Mapping):
        skip = [skip_keys] if isinstance(skip_keys, str) else (skip_keys or [])
        moved_map = {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                     for k, v in tensor.items()}
        rebuild: Callable[..., object] = type(tensor)  # the concrete mapping class (dict, BatchEncoding, ...)
        try:
            return rebuild(moved_map)
        except TypeError:
            return moved_map
    to = getattr(tensor, "to", None)
    if callable(to):
        try:
            return to(device)
        except TypeError:
            return tensor
    return tensor
