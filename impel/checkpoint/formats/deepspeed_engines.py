"""DeepSpeed's part of ``save_state`` / ``load_state`` and of ``merge_weights``.

Each engine writes its own checkpoint (``engine.save_checkpoint``) under ``deepspeed[_i]/zero`` inside impel's
checkpoint directory: module states from rank 0, ZeRO optimizer partitions (float32 masters and states) from every
rank. impel's checkpointer adds schedulers, RNG, counters and the manifest around it, and commits atomically.

DeepSpeed reads its files with ``torch.load(weights_only=False)``. impel never lets it: :func:`safe_loading` forces
``weights_only=True`` (torch's own switch) with an allowlist of the few plain-data classes DeepSpeed pickles, so
loading a checkpoint cannot execute code. Nothing here imports deepspeed until a function runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import torch

from impel.checkpoint import formats
from impel.checkpoint.errors import CheckpointError
from impel.config import environment as env

FORMAT = formats.DEEPSPEED.name
TAG = "zero"
INSTALL_HINT = "pip install 'impel[deepspeed]'"


def _safe_globals() -> list[Any]:
    """The plain-data classes DeepSpeed pickles into its checkpoints (an enum, a dataclass, loss-scaler state)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Every ``torch.load`` inside runs with ``weights_only=True`` and DeepSpeed's data classes allowed."""
    with env.forced_weights_only_load(), torch.serialization.safe_globals(_safe_globals()):
        yield


def folder_name(index: int) -> str:
    return "deepspeed" if index == 0 else f"deepspeed_{index}"


def save_engines(engines: Sequence[Any], directory: Path, *, stages: Sequence[int], trained: AbstractSet[int],
                 world: int, dtype: torch.dtype,
                 engine_kwargs: Mapping[str, object] = {}) -> Mapping[str, object]:  # noqa: B006
    """Every rank writes its part; returns the ``strategy`` section of the checkpoint metadata. ``engines``:
    DeepSpeedEngine modules (typed Any: deepspeed has no type information); ``stages``: each engine's ZeRO stage
    (engines built under several DeepSpeed plugins differ); ``trained``: the indices of engines with an optimizer.

    An engine saves module and optimizer together, so a save pre-hook that takes over a model does not keep its
    weights out of the engine checkpoint. A ZeRO-3 engine without optimizer (a frozen reference model, prepared
    alone) is not written: DeepSpeed 0.19's ``save_checkpoint`` does not complete for it on 2 ranks, and nothing in it
    changes while training; it is listed under ``frozen`` and keeps its weights at load."""
    names = [folder_name(i) for i in range(len(engines))]
    frozen = [i for i, stage in enumerate(stages) if stage == 3 and i not in trained]
    for index, (name, engine) in enumerate(zip(names, engines)):
        if index in frozen:
            continue
        engine.save_checkpoint(str(directory / name), tag=TAG, client_state={}, save_latest=False,
                               **engine_kwargs)  # save_state(**kwargs), e.g. exclude_frozen_parameters
    return {"format": FORMAT, "models": names, "tag": TAG, "zero_stage": max(stages, default=0),
            "zero_stages": list(stages), "frozen": frozen, "world_size": world,
            "dtype": str(dtype).replace("torch.", "")}


def load_engines(engines: Sequence[Any], directory: Path, metadata: Mapping[str, Any],
                 skip: AbstractSet[int], *, stages: Sequence[int], world: int,
                 engine_kwargs: Mapping[str, object] = {}) -> None:  # noqa: B006
    """Restore module, float32 masters and optimizer states of each engine (schedulers are impel's)."""
    _check_loadable(directory, metadata, skip, stage=max(stages, default=0), world=world)
    saved = metadata.get("zero_stages")
    if saved is not None and list(saved) != list(stages):
        raise CheckpointError(f"{directory} holds engines of ZeRO stages {list(saved)} but this run prepared stages "
                              f"{list(stages)}; prepare the same models under the same DeepSpeed plugins, in the same "
                              "order, as the run that saved it")
    frozen = set(metadata.get("frozen", ()))
    for index, (name, engine) in enumerate(zip(metadata["models"], engines)):
        if index in frozen:
            continue  # a frozen ZeRO-3 engine: not written, its weights are the ones it was prepared with
        with safe_loading():
            kwargs = {"load_optimizer_states": engine.optimizer is not None, **engine_kwargs}
            path, _ = engine.load_checkpoint(str(directory / name), tag=metadata["tag"],
                                             load_lr_scheduler_states=False, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no engine checkpoint in {directory / name}; the checkpoint is "
                                  "incomplete or was not written by DeepSpeed")


def _check_loadable(directory: Path, metadata: Mapping[str, Any], skip: AbstractSet[int], *, stage: int,
                    world: int) -> None:
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{directory} holds a {metadata.get('format')!r} checkpoint, which DeepSpeed cannot "
                              "resume; resume with the strategy that saved it, or export it with merge_weights and "
                              "load the weights into the model before prepare()")
    saved = metadata.get("world_size")
    if saved != world and stage > 0:
        raise CheckpointError(f"{directory} holds ZeRO partitions of {saved} ranks but this job has {world}; resume on "
                              f"{saved} ranks, or export full weights with impel.merge_weights and start from them")
    if skip:
        raise CheckpointError(f"a load_state pre-hook took over model(s) {sorted(skip)}, but DeepSpeed restores module "
                              "and optimizer together from its engine checkpoint; leave the DeepSpeed model in the "
                              "hook's list")


def merge_zero_checkpoint(directory: Path, metadata: Mapping[str, Any], model_index: int) -> dict[str, torch.Tensor]:
    """Full float32 weights of model ``model_index`` (what ``merge_weights`` writes), on one process.

    ZeRO stages 1-3: the float32 master partitions, consolidated by DeepSpeed's own ``zero_to_fp32``. Stage 0
    keeps no partitions: the module weights the engine saved, as float32."""
    try:
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )
    except ImportError as exc:
        raise ImportError(f"merging a DeepSpeed checkpoint needs DeepSpeed ({exc}); run {INSTALL_HINT}") from exc
    if model_index in metadata.get("frozen", ()):
        raise CheckpointError(f"model {model_index} of {directory} is a frozen ZeRO-3 engine (prepared without "
                              "optimizer), whose weights the checkpoint does not hold; save them with "
                              "accelerator.save_model(model, ...) instead")
    folder = directory / metadata["models"][model_index]
    tag = metadata.get("tag", TAG)
    with safe_loading():
        stages = metadata.get("zero_stages") or [metadata.get("zero_stage", 1)] * len(metadata["models"])
        if stages[model_index] == 0:
            state = torch.load(folder / tag / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
        else:
            state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
    return {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}
