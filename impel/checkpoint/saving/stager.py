"""The staging copy of an asynchronous save into CPU buffers that are allocated once and reused by every save.

DCP's ``DefaultStager`` caches its buffers by the identity of the source storage's Python object, which torch
frees between saves whenever nothing else holds it (the local tensors of FSDP2's DTensors, the state dicts
``get_model_state_dict`` builds anew): every save then allocates fresh buffers and faults in their pages while it
copies, which costs more than the copy (2.5 copies' time per asynchronous FSDP save, issue 29). :class:`Stager`
keys its buffers by where a tensor sits in the staged state instead (the write's position in the save and the
path of keys to the tensor), so a save of the same layout copies into the same memory, already faulted in (and
pinned where CUDA exists). Tensors sharing a storage (tied weights) share one staged storage; a DTensor is staged
as its local shard wrapped again with the same mesh and placements (no communication). Whatever is not a tensor
is deep-copied (numbers, strings, small containers). The caller must not stage again while a write still reads
the previous staged copy: ``save_state`` waits for the pending save first.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Path = tuple[object, ...]  # the save's key, then the keys and indices down to a tensor
Shared = tuple[torch.device, int, int]  # a source storage: its device, address and length


_IMMUTABLE = frozenset({int, float, bool, complex, str, bytes, type(None)})


class _Shard:
    """A staged DTensor's local shard with what it takes to wrap it again (the source's spec; no reference to the
    source tensor itself)."""

    __slots__ = ("local", "spec", "mesh", "placements", "shape", "stride")

    def __init__(self, local: torch.Tensor, source: DTensor) -> None:
        self.local = local
        self.spec = getattr(source, "_spec", None)
        self.mesh, self.placements = source.device_mesh, source.placements
        self.shape, self.stride = source.shape, source.stride()

    def wrap(self) -> DTensor:
        from torch.distributed.tensor import DTensor

        if self.spec is not None:
            try:  # the source's own spec (mesh, placements, global shape): no checks, no autograd function
                return DTensor(self.local, self.spec, requires_grad=False)
            except (AttributeError, TypeError):  # a torch whose DTensor constructor differs
                pass
        return DTensor.from_local(self.local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


def rewrapped(obj: Any) -> Any:
    """``obj`` (a staged state) with the placeholders of :meth:`Stager.stage` ``(rewrap=False)`` wrapped again as
    DTensors; containers are rebuilt only where something inside changed."""
    if isinstance(obj, _Shard):
        return obj.wrap()
    if type(obj) in (dict, list, tuple) or (isinstance(obj, dict) and hasattr(obj, "move_to_end")):
        if isinstance(obj, dict):
            out = type(obj)()
            for k, v in obj.items():
                out[k] = rewrapped(v)
            return out
        items = [rewrapped(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


class Stager:
    """CPU copies of state (dicts, lists, tuples of tensors, DTensors and plain data) into reused buffers."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[Path, torch.UntypedStorage] = {}

    def stage(self, state: Any, key: object = None, rewrap: bool = True) -> Any:
        """A copy of ``state`` whose tensors live in this stager's buffers for ``key`` (the same key next time:
        the same buffers, reallocated only where a size changed). ``rewrap=False``: DTensors come back as
        placeholders holding the staged local shard, for :func:`rewrapped` to wrap again later (off the caller's
        critical path: ``staging.Deferred`` does it on the background thread)."""
        staged = self._copy(state, (key,), {})
        return rewrapped(staged) if rewrap else staged

    def close(self) -> None:
        """Free the buffers (``end_training``, or memory pressure); the next stage allocates again."""
        self._buffers.clear()

    def held_bytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self._buffers.values())

    def _copy(self, obj: Any, path: Path, memo: dict[Shared, torch.UntypedStorage]) -> Any:
        if type(obj) in _IMMUTABLE:  # as deepcopy would: the object itself (a Python RNG state holds 625 ints,
            return obj               # deep-copied one by one that was 1 ms of an asynchronous save's call)
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            shard = getattr(obj, "_local_tensor", None)  # to_local() goes through dynamo's wrapper: 0.1 ms a call
            local = self._tensor(shard if isinstance(shard, torch.Tensor) else obj.to_local(), path, memo)
            return _Shard(local, obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, memo)
        if type(obj) in (dict, list, tuple) or (isinstance(obj, dict) and hasattr(obj, "move_to_end")):
            return self._container(obj, path, memo)
        return copy.deepcopy(obj)

    def _container(self, obj: Any, path: Path, memo: dict[Shared, torch.UntypedStorage]) -> Any:
        if isinstance(obj, dict):
            out = type(obj)()
            for k, v in obj.items():
                out[k] = self._copy(v, (*path, k), memo)
            return out
        items = [self._copy(v, (*path, i), memo) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)

    def _tensor(self, tensor: torch.Tensor, path: Path, memo: dict[Shared, torch.UntypedStorage]) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_meta or tensor.layout != torch.strided or type(tensor) is not torch.Tensor:
            return copy.deepcopy(tensor)
        source = tensor.untyped_storage()
        shared = (tensor.device, source.data_ptr(), source.nbytes())
        staged = memo.get(shared)
        if staged is None:
            staged = self._buffer(path, source.nbytes())
            staged.copy_(source)
            memo[shared] = staged
        out = torch.empty(0, dtype=tensor.dtype)
        out.set_(staged, tensor.storage_offset(), tensor.size(), tensor.stride())
        return out

    def _buffer(self, path: Path, nbytes: int) -> torch.UntypedStorage:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.nbytes() != nbytes:
            pin = self.pin_memory and nbytes >= 4096
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
            self._buffers[path] = buffer
        return buffer
