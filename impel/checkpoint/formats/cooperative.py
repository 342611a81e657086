"""FULL_STATE_DICT under FSDP without gathering: every rank writes its own shards' bytes into the one full file.

A full safetensors file is a header (names, dtypes, shapes, byte ranges) and the tensors' bytes, row-major, one
after the other. Every rank can compute the header from the global shapes alone, and a DTensor shard is a box of
the global tensor whose rows are contiguous runs of the file. So instead of gathering the whole state on rank 0
(which holds it all in memory and writes it alone while the others wait), each rank opens the same file,
``pwrite``\\ s the runs of the shards it holds at their final offsets (rank 0 also writes the header and what is
not sharded), and fsyncs; the file is complete once every rank returned, which the save sequence's next
collective establishes. A replicated dimension (HSDP's replicas) is written by its first replica only. The file is
an ordinary safetensors file: ``safetensors.safe_open`` reads it, and so does every loader of a full checkpoint.

Used for the model weights (``model*.safetensors``) and, as ``optimizer*.safetensors``, for an optimizer whose
state is tensors keyed by parameter name plus JSON-able hyper-parameters (AdamW, SGD, ...: every torch optimizer
here); anything else falls back to the gathered path. The ranks must write into the same directory (one shared
file system): with ``save_on_each_node`` impel gathers as before.

Each rank writes the whole pages of its runs around the page cache (``direct_io``) and hashes every run from memory
as it writes it; the manifest lists one block per run (format version 4: ``block_ends``), so the file is never
read back to be hashed (``digests.finish_ranges``, merged by ``digests.share_digests``).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from impel.checkpoint.io import hashing
from impel.checkpoint.io.direct_io import DirectFile, reserve
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

    from impel.checkpoint.saving.session import SaveSession
    from impel.types import JSON

ALIASES_KEY = "impel_aliases"
OPTIMIZER_GROUPS_KEY = "impel_param_groups"
SEPARATOR = "/"  # optimizer keys: state/<parameter name>/<state name>

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass
class _Part:
    """One tensor of the file: where it goes and, if this rank writes some of it, which runs of its local data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    local: torch.Tensor | None  # this rank's data to write (None: another rank writes it)
    offsets: tuple[int, ...]  # where the local box starts in the global tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs of a box ``offsets + sizes`` of a row-major tensor of ``shape``: (element offset in the
    global tensor, element offset in the box's own row-major data, element count)."""
    if math.prod(sizes) == 0:
        return
    n = len(shape)
    split = n  # dims from `split` on are whole in the box: one run spans them
    while split > 0 and sizes[split - 1] == shape[split - 1]:
        split -= 1
    if split == 0:
        yield 0, 0, math.prod(shape)
        return
    run = math.prod(sizes[split - 1:])  # the first partial dim's extent times the whole dims after it
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    local_at = 0
    for index in itertools.product(*(range(extent) for extent in sizes[:split - 1])):
        start = sum((offsets[d] + index[d]) * strides[d] for d in range(split - 1))
        yield start + offsets[split - 1] * strides[split - 1], local_at, run
        local_at += run


# mesh -> (global shape, placements) -> (this rank writes its box, the box's offsets): a function of the layout
# only, the same for every tensor of that shape and at every save (computing it costs ~60 us a tensor, ~15 ms a
# save of a 6-layer GPT-2 with AdamW); weak on the mesh, so a finished run's meshes are not kept
_BOXES: weakref.WeakKeyDictionary[DeviceMesh, dict[tuple[tuple[int, ...], tuple[Placement, ...]],
                                                   tuple[bool, tuple[int, ...]]]] = weakref.WeakKeyDictionary()


def _part(name: str, value: torch.Tensor, rank: int) -> _Part:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor):
        mesh = value.device_mesh
        boxes = _BOXES.setdefault(mesh, {})
        key = (tuple(value.shape), tuple(value.placements))
        if key not in boxes:
            coordinate = mesh.get_coordinate()
            writes = coordinate is not None and all(
                c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))
            boxes[key] = writes, tuple(value.__create_chunk_list__()[0].offsets)  # the local box, as DCP has it
        writes, offsets = boxes[key]
        local = value.to_local().detach() if writes else None
        return _Part(name, value.dtype, tuple(value.shape), local, offsets)
    value = value.detach()
    return _Part(name, value.dtype, tuple(value.shape), value if rank == 0 else None, (0,) * value.dim())


def _header(parts: list[_Part], metadata: Mapping[str, str]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (8-byte length + JSON padded to 8 bytes) and each tensor's data offset."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)}
    starts: dict[str, int] = {}
    at = 0
    for part in parts:
        if part.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {part.name!r} has dtype {part.dtype}, which safetensors cannot store; "
                                  "use state_dict_type SHARDED_STATE_DICT")
        entries[part.name] = {"dtype": _DTYPES[part.dtype], "shape": list(part.shape),
                              "data_offsets": [at, at + part.nbytes]}
        starts[part.name] = at
        at += part.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, starts


def write(session: SaveSession, tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str],
          rank: int) -> None:
    """Collective in effect (every rank of the mesh calls it with the same names): write this rank's share of the
    full safetensors file ``path``; tied names (the very same tensor object) are stored once, as the full
    checkpoint's other writer does. During a save (``session.sealing``) the last writes and the fsync go on in the
    background, the save's digests waiting for them; else it returns after this rank's bytes are on disk."""
    write_files(session, [(tensors, path, metadata)], rank)


def write_files(session: SaveSession, files: Sequence[tuple[Mapping[str, torch.Tensor], Path, Mapping[str, str]]],
                rank: int) -> None:
    """:func:`write` for several files (a save's model and optimizer files), every file's length reserved before
    the first byte is written: a reserve (``fallocate``) made while another file's writes and fsync are in flight
    waits for the file system's journal (15-19 ms measured on a FULL save of a 6-layer GPT-2), one made before
    any write costs ~0.2 ms."""
    plans = [_Plan(tensors, metadata, rank) for tensors, _, metadata in files]
    waiting: list[DirectFile] = []  # opened, not yet handed to finish_ranges
    try:
        for (_, path, _), plan in zip(files, plans):
            waiting.append(DirectFile(path, shared=True))
            if os.fstat(waiting[-1].fileno()).st_size != plan.total:  # each rank: the same length, in any order
                reserve(waiting[-1].fileno(), plan.total)
        for plan in plans:
            ranges = plan.write(waiting[0], rank)
            session.finish_ranges(waiting.pop(0), plan.total, ranges)
    except BaseException:
        for file in waiting:
            file.abort()
        raise


class _Plan:
    """A full file: its parts (this rank's data of each tensor, in the file's order), header and length."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], rank: int) -> None:
        seen: dict[int, str] = {}
        aliases: dict[str, str] = {}
        self.parts: list[_Part] = []
        for name in sorted(tensors):
            value = tensors[name]
            if id(value) in seen:
                aliases[name] = seen[id(value)]
                continue
            seen[id(value)] = name
            self.parts.append(_part(name, value, rank))
        meta = dict(metadata, format="pt")
        if aliases:
            meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
        self.header, self.starts = _header(self.parts, meta)
        self.total = len(self.header) + sum(p.nbytes for p in self.parts)

    def write(self, file: DirectFile, rank: int) -> list[tuple[int, int, str]]:
        """This rank's runs (rank 0: the header too) written at their offsets, each hashed from memory as it is
        written; returns the ranges (start, end, digest)."""
        ranges = _Ranges()
        if rank == 0:
            file.write_at(0, self.header)
            ranges.add(0, memoryview(self.header))
        for part in self.parts:
            if part.local is None:
                continue
            data = part.local.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            view = data.data  # numpy's memoryview of the bytes: no copy
            size = part.dtype.itemsize
            base = len(self.header) + self.starts[part.name]
            for at, local_at, count in runs(part.shape, part.offsets, tuple(part.local.shape)):
                piece = view[local_at * size:(local_at + count) * size]
                file.write_at(base + at * size, piece)
                ranges.add(base + at * size, piece)
        return ranges.finish()


class _Ranges:
    """The byte ranges this rank wrote, each hashed from memory as it is written (runs that continue the previous
    one extend it): the manifest's blocks of a file several ranks wrote (``digests.finish_ranges``)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, int, str]] = []
        self._start = self._end = -1
        self._hash: hashing.BlockHasher | None = None

    def add(self, offset: int, data: memoryview) -> None:
        if offset != self._end or self._hash is None:
            self._close()
            self._start, self._end, self._hash = offset, offset, hashing.BlockHasher(1 << 62)
        self._hash.update(data)
        self._end += data.nbytes

    def _close(self) -> None:
        if self._hash is not None:
            self.done.append((self._start, self._end, self._hash.finish()[0]))
            self._hash = None

    def finish(self) -> list[tuple[int, int, str]]:
        self._close()
        return self.done


# --- optimizers ------------------------------------------------------------------------------------------------
def optimizer_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """An optimizer state dict keyed by parameter name as (tensors, metadata) for :func:`write`, or None when some
    state is not a tensor or a hyper-parameter is not JSON-able (the caller gathers and pickles instead)."""
    tensors: dict[str, torch.Tensor] = {}
    for param, entries in state.get("state", {}).items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or SEPARATOR in str(param) or SEPARATOR in key:
                return None
            tensors[f"state{SEPARATOR}{param}{SEPARATOR}{key}"] = value
    try:
        groups = json.dumps(_tagged(state.get("param_groups", [])), allow_nan=True)
    except (TypeError, ValueError):
        return None
    return tensors, {OPTIMIZER_GROUPS_KEY: groups}


def optimizer_state_from(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_tensors`."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, param, key = name.split(SEPARATOR)
        state.setdefault(param, {})[key] = value
    return {"state": state, "param_groups": _untagged(json.loads(metadata[OPTIMIZER_GROUPS_KEY]))}


def _tagged(value: object) -> JSON:
    """JSON cannot tell a tuple (AdamW's betas) from a list: tuples are tagged, so they come back as tuples."""
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("non-string keys")
        return {k: _tagged(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} is not JSON")


def _untagged(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_untagged(v) for v in value["__tuple__"])
        return {k: _untagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value
