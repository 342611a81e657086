"""FULL_STATE_DICT loads under FSDP without redistribution: every rank reads only its own shards' bytes.

The inverse of ``cooperative``: a full safetensors file stores each tensor row-major at a byte range its header
names, and a DTensor shard is a box of the global tensor whose rows are contiguous runs of that range. torch's
``set_model_state_dict(full_state_dict=True)`` instead takes the whole tensors on every rank and scatters each one
from rank 0 over the process group (``distribute_tensor``: one collective per tensor, most of a full load's time),
then copies the shard into the parameter. Here each rank reads the runs of the boxes it holds straight from the file
into new local tensors, wraps them as DTensors with the parameters' own mesh and placements, and hands them to
``set_model_state_dict`` / ``set_optimizer_state_dict`` as a sharded state dict: no collective, and no rank holds a
full tensor. Each rank checks the blocks it reads (a file the ranks wrote cooperatively has one block per range a
rank wrote: on the saving layout each rank reads exactly its own, so the file is read once in all); a file with
blocks of a fixed size (earlier releases, the gathered path) is checked whole on every rank, the bytes a rank did
not need hashed from the file when it is done.

Used for ``model*.safetensors`` and cooperatively written ``optimizer*.safetensors`` (``cooperative``); the other
layouts (``pytorch_model*.bin``, gathered ``optimizer*.pt``) keep the full-state path (``full.load_full``).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from impel.checkpoint.formats import cooperative
from impel.checkpoint.io import safetensors_stream
from impel.checkpoint.io.verified import Manifest, open_checked
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.nn.modules.module import _IncompatibleKeys

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _Target:
    """What one rank needs of one stored tensor: its box (offsets, sizes) and the DTensor to mimic (or None)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    like: torch.Tensor  # the model's DTensor (mesh, placements, device), or the plain tensor for unsharded values


def target_of(value: torch.Tensor) -> _Target:
    """The box of the global tensor this rank holds for ``value`` (a DTensor's local shard, or the whole tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        chunk = value.__create_chunk_list__()[0]  # the local box, as the cooperative writer records it
        return _Target(tuple(chunk.offsets), tuple(chunk.sizes), value)
    return _Target((0,) * value.dim(), tuple(value.shape), value)


def read_boxes(manifest: Manifest | None, path: Path,
               targets: Callable[[Mapping[str, Any], Mapping[str, Shape]], Mapping[str, _Target]],
               what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read each named box of the safetensors file ``path`` (checked against the manifest as it is read), as local
    tensors in the dtype stored; returns them and the file's metadata. ``targets(header entries, shapes)``: the
    boxes wanted, by name, given the header and the global shape of every name the file holds (tied names too).

    A name of ``targets`` the file does not hold is left out (the caller decides whether that is an error); a
    name whose stored shape differs from its target's global shape raises, naming both shapes."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing; load a complete checkpoint")
    try:
        with open_checked(manifest, path) as stream:
            entries, metadata, base = safetensors_stream.read_header(stream)
            shapes: dict[str, Shape] = {name: tuple(entry["shape"]) for name, entry in entries.items()}
            aliases = json.loads(metadata.get(cooperative.ALIASES_KEY, "{}"))
            shapes.update({alias: shapes[stored] for alias, stored in aliases.items() if stored in shapes})
            out, reads = _plan(path, entries, aliases, targets(entries, shapes))
            touched_only = getattr(stream, "verify_touched_only", None)
            # the checking reader: check only what this rank reads (per-range blocks), else hash the other ranks'
            # bytes in order
            skip = None if touched_only is None or touched_only() else getattr(stream, "hash_up_to", None)
            if skip is None and hasattr(stream, "plan"):  # only this rank's bytes are read: only those asked ahead
                stream.plan([(base + at, base + at + view.nbytes) for at, view in reads])
            for at, view in sorted(reads, key=lambda r: r[0]):  # in file order: one forward pass over the file
                if skip is not None:
                    skip(base + at)
                stream.seek(base + at)
                safetensors_stream.fill(stream, view)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed header raises whatever json or torch raise
        raise CheckpointError(f"checkpoint file {path} ({what}) is not a valid safetensors file ({exc}); it is "
                              "truncated or corrupted: load an earlier checkpoint") from None
    return out, metadata


def _plan(path: Path, entries: Mapping[str, Any], aliases: Mapping[str, str], targets: Mapping[str, _Target],
          ) -> tuple[dict[str, torch.Tensor], list[tuple[int, memoryview]]]:
    """New local tensors for every target the file holds, and the (file offset, destination bytes) reads."""
    out: dict[str, torch.Tensor] = {}
    reads: list[tuple[int, memoryview]] = []
    done: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for name, target in targets.items():
        stored = aliases.get(name, name)
        entry = entries.get(stored)
        if entry is None:
            continue
        dtype, shape = safetensors_stream.dtype_of(entry), tuple(entry["shape"])
        if shape != tuple(target.like.shape):  # the caller's check names the model; this guards the reads
            raise CheckpointError(f"{path} does not fit: {name!r} has shape {list(shape)} in the checkpoint but "
                                  f"{list(target.like.shape)} where it is loaded; load it into the model it was "
                                  "saved from")
        key = (stored, target.offsets, target.sizes)
        if key in done:  # tied weights: one read, the same tensor under both names
            out[name] = done[key]
            continue
        local = torch.empty(target.sizes, dtype=dtype)
        out[name] = done[key] = local
        if local.numel() == 0:
            continue
        data = local.reshape(-1).view(torch.uint8).numpy().data
        size, start = dtype.itemsize, int(entry["data_offsets"][0])
        for at, local_at, count in cooperative.runs(shape, target.offsets, target.sizes):
            reads.append((start + at * size, data[local_at * size:(local_at + count) * size]))
    return out, reads


def as_sharded(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` on ``like``'s device, wrapped as a DTensor with ``like``'s mesh and placements when ``like`` is one."""
    from torch.distributed.tensor import DTensor

    device = like.to_local().device if isinstance(like, DTensor) else like.device
    local = local.to(device=device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    return local


def load_model(manifest: Manifest | None, model: nn.Module, path: Path, options: StateDictOptions | None,
               check: Callable[[Mapping[str, Shape]], None]) -> _IncompatibleKeys:
    """Load a full ``model*.safetensors`` into a (sharded) prepared model, each rank reading its own boxes; returns
    ``set_model_state_dict``'s result (missing / unexpected keys under ``strict=False``). ``check(shapes)``: raises
    when the file's names and global shapes do not fit the model, before anything is read."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    current = get_model_state_dict(model)  # DTensors: the parameters' own layout
    targets = {name: target_of(value) for name, value in current.items() if isinstance(value, torch.Tensor)}

    def boxes(_: Mapping[str, Any], shapes: Mapping[str, Shape]) -> dict[str, _Target]:
        check(shapes)
        return targets

    locals_, _ = read_boxes(manifest, path, boxes, "model weights")
    state: dict[str, Any] = {name: as_sharded(local, targets[name].like) for name, local in locals_.items()}
    return set_model_state_dict(model, state, options=StateDictOptions(strict=getattr(options, "strict", True)))


def load_optimizer(manifest: Manifest | None, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                   options: StateDictOptions | None) -> bool:
    """Load a cooperatively written ``optimizer*.safetensors`` into the optimizer of a (sharded) prepared model,
    each rank reading its own boxes of the state tensors shaped like their parameter; False when the optimizer was
    saved before its first step (no state: the caller restores its hyper-parameters)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_optimizer_state_dict,
    )

    params = {name: value for name, value in get_model_state_dict(model).items() if isinstance(value, torch.Tensor)}
    targets: dict[str, _Target] = {}

    def boxes(entries: Mapping[str, Any], shapes: Mapping[str, Shape]) -> dict[str, _Target]:
        for name, entry in entries.items():
            if not name.startswith(f"state{cooperative.SEPARATOR}"):
                continue
            param = name.split(cooperative.SEPARATOR)[1]
            like, shape = params.get(param), tuple(entry["shape"])
            if like is not None and tuple(like.shape) == shape:
                targets[name] = target_of(like)  # a moment of the parameter: the parameter's own box
            else:  # a scalar (Adam's step) or a state shaped unlike its parameter: the whole tensor on every rank
                meta = torch.empty(shape, dtype=safetensors_stream.dtype_of(entry), device="meta")
                targets[name] = _Target((0,) * len(shape), shape, meta)
        return targets

    locals_, metadata = read_boxes(manifest, path, boxes, "optimizer state")
    if not targets:
        return False
    state: dict[str, dict[str, Any]] = {}
    for name, local in locals_.items():
        _, param, key = name.split(cooperative.SEPARATOR)
        like = targets[name].like
        state.setdefault(param, {})[key] = local if like.is_meta else as_sharded(local, like)
    try:
        groups = cooperative.optimizer_state_from({}, metadata)["param_groups"]
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} (optimizer state) is not a valid optimizer file ({exc}); it "
                              "is truncated or corrupted: load an earlier checkpoint") from None
    strict = getattr(options, "strict", True)
    loaded: dict[str, Any] = {"state": state, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, loaded, options=StateDictOptions(strict=strict))
    return True

