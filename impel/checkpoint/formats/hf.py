"""Full model weights in Hugging Face's layout, as ``from_pretrained`` reads them.

One file (``model.safetensors``) when the weights fit ``max_shard_size``, else shards
``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": N},
"weight_map": {name: file}}``). ``safe_serialization=False`` writes ``pytorch_model*.bin`` the same way. Tied
weights are stored once (the first name keeps the data), as transformers does.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from impel.checkpoint.io.files import dedupe_aliases, write_safetensors, write_torch
from impel.checkpoint.saving.session import SaveSession
from impel.checkpoint.store.layout import fsync_dir
from impel.checkpoint.store.ownership import refuse_inside_checkpoint

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(max_shard_size: int | str) -> int:
    """Bytes from ``10GB``, ``500MB``, ``1.5GiB`` or an integer."""
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool) and max_shard_size > 0:
        return max_shard_size
    match = _SIZE.match(max_shard_size) if isinstance(max_shard_size, str) else None
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} is not a size; use bytes as an int or a string like "
                         "'10GB', '500MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_shards(state: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names per shard, in order; a shard closes before it would pass ``max_bytes`` (one big tensor stays alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = _nbytes(tensor)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def weight_names(safe_serialization: bool) -> tuple[str, str, str]:
    """(single file, shard pattern, index file) for the chosen serialization."""
    if safe_serialization:
        return "model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"
    return "pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"


def save_pretrained_weights(state: Mapping[str, torch.Tensor], directory: str | os.PathLike[str],
                            safe_serialization: bool = True, max_shard_size: int | str = "10GB") -> list[Path]:
    """Write ``state`` into ``directory`` in Hugging Face's layout; returns the files written."""
    limit = parse_size(max_shard_size)
    out = Path(directory)
    refuse_inside_checkpoint(out, "the output directory")
    if out.is_file():
        raise NotADirectoryError(f"save_directory {out} is a file; pass a directory path")
    out.mkdir(parents=True, exist_ok=True)
    kept, _ = dedupe_aliases(state)
    single, pattern, index_name = weight_names(safe_serialization)
    shards = plan_shards(kept, limit)
    names = [single] if len(shards) == 1 else [pattern.format(i + 1, len(shards)) for i in range(len(shards))]
    _remove_stale(out, set(names))
    written = []
    for name, keys in zip(names, shards):
        part = {k: kept[k] for k in keys}
        tmp = out / f".{name}.tmp"
        plain = SaveSession.plain()  # written and fsynced at once (not a save_state checkpoint)
        write_safetensors(plain, part, tmp) if safe_serialization else write_torch(plain, part, tmp)
        os.replace(tmp, out / name)
        written.append(out / name)
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in kept.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (out / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(out / index_name)
    fsync_dir(out)
    return written


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """Delete weight files of an earlier save into the same directory that this save does not rewrite."""
    stale = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin"
                       r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json)$")
    for entry in directory.iterdir():
        if entry.is_file() and stale.match(entry.name) and entry.name not in keep:
            entry.unlink()
