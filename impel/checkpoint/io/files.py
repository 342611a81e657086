"""Reading and writing checkpoint files without ever executing pickled code.

Tensors go to safetensors (no code at all). Everything else goes through ``torch.save`` and comes back through
``torch.load(weights_only=True)``, whose unpickler only rebuilds tensors, numbers, strings and containers: a file
that asks for any other global (``os.system``, a user class) fails to load and runs nothing. Every writer fsyncs
and is checksummed as it writes (during save_state in the background: see ``digests``); every reader checks the
manifest's checksums as it reads (during load_state: see ``verified``).
"""
from __future__ import annotations

import json
import pickle
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from impel.checkpoint.io import safetensors_stream
from impel.checkpoint.io.verified import Manifest, open_checked
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from impel.checkpoint.saving.session import SaveSession

ALIASES_KEY = "impel_aliases"


def _storage_key(tensor: torch.Tensor) -> tuple[object, ...]:
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def dedupe_aliases(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop names that are the very same tensor as an earlier name (tied weights); return (kept, alias -> kept).

    Tensors that share memory without being identical views are copied, since safetensors stores each name once.
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    storages: dict[tuple[torch.device, int], int] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        key = _storage_key(tensor)
        if tensor.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor
        ptr = (tensor.device, tensor.untyped_storage().data_ptr())
        storages[ptr] = storages.get(ptr, 0) + 1
    for name, tensor in kept.items():
        shared = storages[(tensor.device, tensor.untyped_storage().data_ptr())] > 1 and tensor.numel() > 0
        tensor = tensor.to("cpu").contiguous()
        kept[name] = tensor.clone() if shared else tensor
    return kept, aliases


def write_safetensors(session: SaveSession, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write tensors (tied ones once, the alias recorded in the metadata), hashed as written, and fsync; in an
    asynchronous save, staged now and written later (``session``)."""
    session.write(_write_safetensors, tensors, path)


def _write_safetensors(session: SaveSession, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    kept, aliases = dedupe_aliases(tensors)
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
    with session.open(path) as f:
        safetensors_stream.write(kept, metadata, f)


def read_safetensors(manifest: Manifest | None, path: Path, what: str = "tensors") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`write_safetensors` (aliases restored), checked as it is read."""
    tensors, metadata = read_safetensors_file(manifest, path, what)
    for alias, target in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
        tensors[alias] = tensors[target]
    return tensors


def read_safetensors_file(manifest: Manifest | None, path: Path,
                          what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata on CPU, checked against the manifest as it is read."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing; load a complete checkpoint")
    try:
        with open_checked(manifest, path) as f:
            return safetensors_stream.read(f)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed header raises whatever json or torch raise
        raise CheckpointError(f"checkpoint file {path} ({what}) is not a valid safetensors file ({exc}); it is "
                              "truncated or corrupted: load an earlier checkpoint") from None


def write_torch(session: SaveSession, obj: object, path: Path) -> None:
    """``torch.save`` then fsync; only save tensors, numbers, strings and containers (they load back safely). In
    an asynchronous save, staged now and written later (``session``).

    The zip records' crc32 is not computed: the manifest's checksum covers every byte, and crc32 costs a pass.
    """
    session.write(_write_torch, obj, path)


def _write_torch(session: SaveSession, obj: object, path: Path) -> None:
    with crc32_off(), session.open(path) as f:
        torch.save(obj, f)


@contextmanager
def crc32_off() -> Iterator[None]:
    """``torch.save`` without the zip records' crc32 (a pass over every byte) where torch allows it."""
    from torch import serialization

    switch = getattr(serialization, "set_crc32_options", None)
    if switch is None:
        yield
        return
    before = serialization.get_crc32_options()
    switch(False)
    try:
        yield
    finally:
        switch(before)


def read_torch(manifest: Manifest | None, path: Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` on CPU; a CheckpointError naming ``what`` and the file otherwise."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing; load a checkpoint saved with the same "
                              "models, optimizers, schedulers, dataloaders and registered objects")
    try:
        with open_checked(manifest, path) as f:  # checked against the checkpoint's manifest as it is read
            return torch.load(f, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        first = f"it asks for {found.group(1)}" if found else type(exc).__name__
        raise CheckpointError(
            f"refusing to load {path} ({what}): it needs a Python object that safe loading does not rebuild "
            f"({first}). impel never runs pickled code. If the file is yours and the object is a registered "
            "object's state, make its state_dict() return tensors, numbers, strings, lists and dicts, or allow "
            "the type with torch.serialization.add_safe_globals([...])") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} ({what}) cannot be read ({exc}); it is truncated or "
                              "corrupted: load an earlier checkpoint") from None
