"""Turn any impel checkpoint into full weights in Hugging Face's layout (what ``impel merge-weights`` runs).

The checkpoint's ``impel_checkpoint.json`` says which format its strategy wrote; ``MERGERS`` (from the formats'
table, ``formats.FORMATS``) maps each format to
a function ``(checkpoint_dir, strategy_metadata, model_index) -> state dict``, as a dotted path to a module of this
layer (DeepSpeed's ZeRO files: ``deepspeed_engines``), imported only when that format is merged.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from impel.checkpoint.formats import FORMATS
from impel.checkpoint.formats.full import read_weights
from impel.checkpoint.formats.hf import save_pretrained_weights
from impel.checkpoint.store.layout import CheckpointError, verify
from impel.checkpoint.store.ownership import refuse_inside_checkpoint

MERGERS: dict[str, str] = {name: fmt.merger for name, fmt in FORMATS.items()}  # the formats' table (formats.py)


def full_weights(directory: Path, metadata: Mapping[str, Any], model_index: int) -> dict[str, torch.Tensor]:
    """Model ``model_index`` of a checkpoint written by :func:`impel.checkpoint.formats.full.save_full`."""
    return read_weights(None, directory / metadata["models"][model_index])  # merge_weights verified every file


def sharded_weights(directory: Path, metadata: Mapping[str, Any], model_index: int) -> dict[str, torch.Tensor]:
    """Model ``model_index`` of a DCP checkpoint, gathered on this process (DTensor shards become full tensors)."""
    from impel.checkpoint.formats.sharded import load_full_state

    state = load_full_state(None, directory / metadata["models"][model_index])  # verified by merge_weights
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def _merger(fmt: str) -> Callable[[Path, Mapping[str, Any], int], dict[str, torch.Tensor]]:
    target = MERGERS.get(fmt)
    if target is None:
        raise CheckpointError(f"checkpoint format {fmt!r} has no merger; known formats: {sorted(MERGERS)}")
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise CheckpointError(f"merging {fmt!r} checkpoints needs {target}, which this impel installation lacks; "
                              "install the matching extra (e.g. impel[deepspeed]) or upgrade impel") from None


def merge_weights(checkpoint_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                  model_index: int = 0, safe_serialization: bool = True,
                  max_shard_size: int | str = "10GB") -> list[Path]:
    """Write model ``model_index`` of an impel checkpoint as full weights in ``out_dir``; returns the files.

    Works on one process without a process group, whatever strategy and world size saved the checkpoint.

    Example::

        merge_weights("runs/a/checkpoints/checkpoint_3", "export/")   # export/model.safetensors
    """
    directory = Path(checkpoint_dir)
    refuse_inside_checkpoint(out_dir, "merge-weights output directory")
    metadata = verify(directory)
    strategy = metadata.get("strategy", {})
    count = len(strategy.get("models", []))
    if not 0 <= model_index < count:
        raise CheckpointError(f"model_index={model_index} is out of range: {directory} holds {count} model(s); "
                              f"use 0..{count - 1}")
    state = _merger(strategy.get("format", "full"))(directory, strategy, model_index)
    return save_pretrained_weights(state, out_dir, safe_serialization, max_shard_size)


def merge_fsdp_weights(checkpoint_dir: str | os.PathLike[str], output_path: str | os.PathLike[str],
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> None:
    """Accelerate's name: write one full-weights file (``model.safetensors``, else ``pytorch_model.bin``) into
    ``output_path`` from an impel checkpoint directory or a bare DCP directory (Accelerate's
    ``pytorch_model_fsdp_0``, impel's ``model/``). The main process merges (``remove_checkpoint_dir`` then deletes
    the source); every process that joined a group waits for it."""
    import shutil

    from impel.runtime.ranks.process import ProcessState, current_topology

    source = Path(checkpoint_dir)
    refuse_inside_checkpoint(output_path, "merge_fsdp_weights output_path")  # checked on every rank, as below
    impel_layout = (source / "impel_checkpoint.json").is_file()
    if not impel_layout and not (source / ".metadata").is_file():  # checked on every rank: none waits in vain
        raise CheckpointError(f"{source} is neither an impel checkpoint (impel_checkpoint.json) nor a DCP directory "
                              "(.metadata); pass checkpoints/checkpoint_N or its model directory")
    if current_topology().rank == 0:
        if impel_layout:
            merge_weights(source, output_path, safe_serialization=safe_serialization, max_shard_size=2**62)
        else:
            from impel.checkpoint.formats.sharded import load_full_state

            state = load_full_state(None, source)  # a bare DCP directory: no manifest
            if len(state) == 1 and isinstance(next(iter(state.values())), dict):  # {"model": {...}}
                state = next(iter(state.values()))
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            save_pretrained_weights(tensors, output_path, safe_serialization, max_shard_size=2**62)
        if remove_checkpoint_dir:
            shutil.rmtree(source)
    if ProcessState._shared.get("initialized"):
        ProcessState().wait_for_everyone()
