"""``load_state`` of a directory written by Accelerate's ``save_state`` (Accelerate 1.x), so a run moves over.

A directory without impel's ``COMPLETE`` marker that holds a file name only Accelerate writes is read this way:

================================================================  ==============================================
Accelerate's file                                                  restored into
================================================================  ==============================================
``model[_i].safetensors`` or ``pytorch_model[_i].bin``             model i (a ``module.`` prefix, tied weights)
``optimizer[_i].bin`` (``optimizer.state_dict()``, by position)    optimizer i, re-keyed by parameter name
FSDP ``pytorch_model_fsdp[_i].bin`` + ``optimizer[_i].bin``        model / optimizer i (FULL_STATE_DICT)
FSDP ``pytorch_model_fsdp_<i>/`` + ``optimizer_<i>/`` (DCP)        model / optimizer i, resharded (SHARDED)
DeepSpeed ``pytorch_model[_i]/`` + ``latest``                      engine i, when impel runs DeepSpeed
``scheduler[_i].bin`` / ``scaler.pt``                              scheduler i / the fp16 GradScaler
``random_states_<rank>.pkl``                                       this rank's python, numpy, torch, CUDA RNG;
                                                                   ``accelerator.step``
``custom_checkpoint_<i>.pkl``                                      registered object i
``sampler[_i].bin`` (a pickled ``SeedableRandomSampler``)          dataloader i's epoch (``set_epoch``)
================================================================  ==============================================

Not restored, because Accelerate does not save it: a dataloader's epoch and its position in it. Accelerate 1.15
writes ``sampler.bin`` only when the dataset is an ``IterableDatasetShard`` *and* the sampler a
``SeedableRandomSampler``, which its ``prepare`` never combines, and its default shuffled loader's sampler generator
is saved nowhere; so, as after Accelerate's own ``load_state``, the loaders start their epoch from the beginning:
call ``set_epoch`` and ``skip_first_batches`` as the Accelerate script did. ``dl_state_dict.bin`` (torchdata's
StatefulDataLoader, whose position format impel's loaders do not share) is skipped with a warning. impel's own
counters that Accelerate lacks (optimizer steps taken) start at 0; the checkpoint number continues from a
``checkpoint_N`` name.

Nothing runs pickled code: tensor files load with ``torch.load(weights_only=True)``, the RNG and registered objects'
pickles through :mod:`.restricted`'s allowlist, ``sampler.bin`` into inert stand-ins, DCP metadata through
:class:`.sharded.SafeFileSystemReader`, DeepSpeed's files under its ``safe_loading``. There is no manifest and so no
checksum: a missing file raises naming it, and every small file is read before anything is changed.
"""
from __future__ import annotations

import logging
import random
import re
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from impel.accelerator.load_accelerate_weights import load_models_and_optimizers
from impel.checkpoint.io.files import read_torch
from impel.checkpoint.io.restricted import RefusedGlobal, load_restricted
from impel.checkpoint.saving.options import DEFAULT_LOAD, LoadOptions
from impel.checkpoint.saving.state import describe
from impel.checkpoint.store import layout
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from impel.accelerator.prepared import TrainingRun

logger = logging.getLogger("impel")

FORMAT = "accelerate"
_PER_RANK_FSDP = re.compile(r"^(pytorch_model_fsdp(_\d+)?|optimizer_\d+)_rank\d+\.bin$")
_IGNORED_RNG = ("torch_xpu_manual_seed", "torch_mlu_manual_seed", "torch_sdaa_manual_seed", "torch_musa_manual_seed",
                "torch_hpu_manual_seed", "torch_neuron_manual_seed", "xm_seed")


def nth(base: str, index: int, ext: str) -> str:
    """Accelerate's numbering: ``optimizer.bin``, ``optimizer_1.bin``, ..."""
    return f"{base}{ext}" if index == 0 else f"{base}_{index}{ext}"


def list_accelerate(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint_N`` directories under ``root`` in Accelerate's layout (automatic naming), oldest first."""
    found = []
    for entry in root.iterdir() if root.is_dir() else ():
        number = layout.parse_iteration(entry.name)
        if number is not None and layout.is_accelerate_dir(entry):
            found.append((number, entry))
    return sorted(found)


# --- what the directory holds (the leader inspects, every rank gets the plan) ---------------------------------------
def inspect(directory: Path) -> dict[str, Any]:
    """A JSON-able plan of ``directory``: which file holds what; raises for layouts impel cannot load."""
    names = {entry.name for entry in directory.iterdir()}
    _refuse_unsupported(directory, names)
    weights, models, optimizers = _weights(directory, names)
    rng_ranks = sorted(int(m.group(1)) for n in names if (m := re.match(r"^random_states_(\d+)\.pkl$", n)))
    if not rng_ranks:
        raise CheckpointError(f"{directory / 'random_states_0.pkl'} is missing: Accelerate's save_state writes one "
                              "per rank, so the directory is an incomplete copy; copy it again")
    return {
        "format": FORMAT, "weights": weights, "models": models, "optimizers": optimizers,
        "schedulers": _series(directory, names, "scheduler", ".bin"),
        "custom": _series(directory, names, "custom_checkpoint", ".pkl", first_numbered=True),
        "samplers": _indexed(names, "sampler", ".bin"), "dl_states": _indexed(names, "dl_state_dict", ".bin"),
        "scaler": "scaler.pt" in names, "rng_ranks": rng_ranks, "world_size": max(rng_ranks) + 1,
        "iteration": layout.parse_iteration(directory.name),
    }


def _refuse_unsupported(directory: Path, names: set[str]) -> None:
    per_rank = sorted(n for n in names if _PER_RANK_FSDP.match(n))
    if per_rank:
        raise CheckpointError(
            f"{directory / per_rank[0]} is a per-rank FSDP shard (Accelerate's LOCAL_STATE_DICT, or "
            "SHARDED_STATE_DICT with use_dcp=False), readable only by FSDP1 on the same ranks; load the directory in "
            "Accelerate and save it again with fsdp_state_dict_type SHARDED_STATE_DICT (DCP) or FULL_STATE_DICT")
    if "latest_checkpointed_iteration.txt" in names:
        raise CheckpointError(f"{directory} is a Megatron-LM checkpoint (latest_checkpointed_iteration.txt), which "
                              "impel cannot load; export the model's weights from Megatron-LM and load them before "
                              "prepare()")


def _indexed(names: set[str], base: str, ext: str) -> dict[str, str]:
    """{index: file name} of ``base[_i]ext`` files (JSON keys are strings)."""
    found = {}
    for name in names:
        match = re.match(rf"^{base}(?:_(\d+))?{re.escape(ext)}$", name)
        if match:
            found[str(int(match.group(1) or 0))] = name
    return found


def _series(directory: Path, names: set[str], base: str, ext: str, first_numbered: bool = False) -> list[str]:
    """Files numbered 0..n-1 (``base.ext``, ``base_1.ext``, ... or ``base_0.ext`` ...); a gap raises naming it."""
    pattern = rf"^{base}_(\d+){re.escape(ext)}$" if first_numbered else rf"^{base}(?:_(\d+))?{re.escape(ext)}$"
    indices = sorted(int(m.group(1) or 0) for n in names if (m := re.match(pattern, n)))
    files = [f"{base}_{i}{ext}" if first_numbered else nth(base, i, ext) for i in range(len(indices))]
    for expected in files:
        if expected not in names:
            raise CheckpointError(f"{directory / expected} is missing (the directory has {sorted(indices)} for "
                                  f"{base}); the Accelerate checkpoint is incomplete: copy it again")
    return files


def _weights(directory: Path, names: set[str]) -> tuple[str, list[str], list[str]]:
    """(layout, model entries, optimizer entries) for plain, FSDP full, FSDP DCP and DeepSpeed directories."""
    tags = sorted((n for n in names if re.match(r"^pytorch_model(_\d+)?$", n)
                   and (directory / n / "mp_rank_00_model_states.pt").is_file()), key=_index_of)
    if tags:
        return "deepspeed", tags, []
    dcp = sorted((n for n in names if re.match(r"^pytorch_model_fsdp_\d+$", n) and (directory / n).is_dir()),
                 key=_index_of)
    if dcp:
        optimizers = sorted((n for n in names if re.match(r"^optimizer_\d+$", n) and (directory / n).is_dir()),
                            key=_index_of)
        return "sharded", _contiguous(directory, dcp, "pytorch_model_fsdp_{}"), \
            _contiguous(directory, optimizers, "optimizer_{}")
    optimizers = _series(directory, names, "optimizer", ".bin")
    fsdp_full = _series(directory, names, "pytorch_model_fsdp", ".bin")
    if fsdp_full:
        return "fsdp_full", fsdp_full, optimizers
    count = max(len(_indexed(names, "model", ".safetensors")), len(_indexed(names, "pytorch_model", ".bin")))
    models = []
    for i in range(count):  # Accelerate reads model_i.safetensors when it exists, else pytorch_model_i.bin
        safe, pickled = nth("model", i, ".safetensors"), nth("pytorch_model", i, ".bin")
        if safe not in names and pickled not in names:
            raise CheckpointError(f"{directory / safe} (or {pickled}) is missing; the Accelerate checkpoint is "
                                  "incomplete: copy it again")
        models.append(safe if safe in names else pickled)
    return "full", models, optimizers


def _index_of(name: str) -> int:
    match = re.search(r"_(\d+)$", name)
    return int(match.group(1)) if match else 0


def _contiguous(directory: Path, entries: list[str], pattern: str) -> list[str]:
    expected = [pattern.format(i) for i in range(len(entries))]
    for name in expected:
        if name not in entries:
            raise CheckpointError(f"{directory / name} is missing; the Accelerate checkpoint is incomplete: copy it "
                                  "again")
    return expected


# --- loading (every rank) -------------------------------------------------------------------------------------------
def load(run: TrainingRun, directory: Path, plan: dict[str, Any], skip: AbstractSet[int],
         options: LoadOptions = DEFAULT_LOAD) -> None:
    """Restore everything ``plan`` lists; the small files are read first, so a bad one changes nothing."""
    prepared, registered = run.prepared, run.prepared.registered
    _check_counts(run, directory, plan, skip)
    rank = run.process_index
    # Accelerate's files: no manifest
    schedulers = [read_torch(None, directory / name, f"scheduler {i}") for i, name in enumerate(plan["schedulers"])]
    custom = [read_pickle(directory / name, f"registered object {i}, {describe(obj)}")
              for i, (name, obj) in enumerate(zip(plan["custom"], registered))]
    scaler = _scaler_state(run, directory, plan)
    rng_file = directory / f"random_states_{rank}.pkl"
    rng = read_pickle(rng_file, f"rank {rank} RNG state") if rank in plan["rng_ranks"] else None
    if rng is not None and not (isinstance(rng, dict) and {"random_state", "torch_manual_seed"} <= rng.keys()):
        raise CheckpointError(f"{rng_file} does not hold Accelerate's RNG states (random_state, torch_manual_seed); "
                              "it was not written by Accelerate's save_state")
    epochs = {int(i): sampler_epoch(directory / name) for i, name in plan["samplers"].items()}
    if plan["world_size"] != run.num_processes and run.is_main_process:
        logger.warning("%s was saved by %d Accelerate processes and is loaded by %d: model and optimizer state load "
                       "as usual, but per-rank RNG streams follow a different layout", directory, plan["world_size"],
                       run.num_processes)

    if scaler is not None:  # before the optimizers, as in impel's own load (FSDP2 steps a dummy optimizer)
        run.strategy.load_precision_state_dict({"scaler": scaler})
    load_models_and_optimizers(run, directory, plan, skip, options)
    for scheduler, state in zip(prepared.schedulers, schedulers):
        scheduler.load_state_dict(state)
    for i, epoch in epochs.items():
        if epoch is not None:
            prepared.dataloaders[i].set_epoch(epoch)
    for i, name in plan["dl_states"].items():
        logger.warning("%s (torchdata StatefulDataLoader state of dataloader %s) is not read: dataloader %s starts "
                       "at the beginning of its epoch; skip the batches already consumed with "
                       "accelerator.skip_first_batches(loader, n)", directory / name, i, i)
    for obj, state in zip(registered, custom):
        obj.load_state_dict(state)
    if rng is None:
        logger.warning("%s is missing (the Accelerate run had %d processes): rank %d's random streams start fresh",
                       rng_file, plan["world_size"], rank)
        return
    _restore_step(run, int(rng.get("step", 0)))
    restore_rng(rng, run.device, rng_file)


def _check_counts(run: TrainingRun, directory: Path, plan: dict[str, Any], skip: AbstractSet[int]) -> None:
    kind, objs, registered = plan["weights"], run.prepared, run.prepared.registered
    # Accelerate numbers plain model files over the models its save hooks left; FSDP and DeepSpeed by model index
    models = len(objs.models) - (len(skip) if kind == "full" else 0)
    hooks = f" (after {len(skip)} taken over by load_state pre-hooks)" if skip and kind == "full" else ""
    model_file = {"full": lambda i: nth("model", i, ".safetensors"), "sharded": "pytorch_model_fsdp_{}/".format,
                  "fsdp_full": lambda i: nth("pytorch_model_fsdp", i, ".bin"),
                  "deepspeed": lambda i: nth("pytorch_model", i, "/")}[kind]
    optimizer_file = "optimizer_{}/".format if kind == "sharded" else lambda i: nth("optimizer", i, ".bin")
    counts = [("model", plan["models"], f"{models} models{hooks}", models, model_file),
              ("scheduler", plan["schedulers"], f"{len(objs.schedulers)} schedulers", len(objs.schedulers),
               lambda i: nth("scheduler", i, ".bin")),
              ("registered object", plan["custom"], f"{len(registered)} registered objects", len(registered),
               "custom_checkpoint_{}.pkl".format)]
    if kind != "deepspeed":  # DeepSpeed keeps the optimizer inside the engine checkpoint
        counts.append(("optimizer", plan["optimizers"], f"{len(objs.optimizers)} optimizers", len(objs.optimizers),
                       optimizer_file))
    for what, saved, prepared, have, file_of in counts:
        if len(saved) == have:
            continue
        listed = f" ({', '.join(saved)})" if saved else ""
        missing = f"{directory / file_of(len(saved))} is missing: " if len(saved) < have else ""
        raise CheckpointError(f"{missing}the Accelerate checkpoint {directory} holds {len(saved)} {what} "
                              f"state(s){listed} but {prepared} are prepared now; prepare (and register) the same "
                              "objects in the same order as the Accelerate run before load_state()")
    loaders = [int(i) for i in (*plan["samplers"], *plan["dl_states"])]
    if loaders and max(loaders) >= len(objs.dataloaders):
        raise CheckpointError(f"the Accelerate checkpoint {directory} holds state for dataloader {max(loaders)} but "
                              f"{len(objs.dataloaders)} dataloaders are prepared now; prepare the same dataloaders")


def _scaler_state(run: TrainingRun, directory: Path, plan: dict[str, Any]) -> Any:
    has_scaler = "scaler" in run.strategy.precision_state_dict()
    path = directory / "scaler.pt"
    if has_scaler and not plan["scaler"]:
        raise CheckpointError(f"{path} is missing: this run scales fp16 losses with a GradScaler but the Accelerate "
                              "run saved none (it trained without fp16 loss scaling); resume with the mixed_precision "
                              "the Accelerate run used")
    if plan["scaler"] and not has_scaler:
        logger.warning("%s is not loaded: this run has no GradScaler (mixed_precision=%r)", path, run.mixed_precision)
        return None
    return read_torch(None, path, "GradScaler state") if has_scaler else None


def read_pickle(path: Path, what: str, inert: bool = False) -> Any:
    """An Accelerate pickle through the allowlist (:mod:`.restricted`); a CheckpointError naming file and global."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) is missing; the Accelerate checkpoint is incomplete")
    try:
        return load_restricted(path, inert=inert)
    except RefusedGlobal as exc:
        global_name = exc.name
    except Exception as exc:  # noqa: BLE001 - a damaged zip, or torch's own refusal under its weights-only switch
        found = re.search(r"GLOBAL (\S+)", str(exc))
        if found is None:
            raise CheckpointError(f"checkpoint file {path} ({what}) cannot be read ({type(exc).__name__}: {exc}); "
                                  "it is truncated or corrupted") from None
        global_name = found.group(1)
    raise CheckpointError(
        f"refusing to load {path} ({what}): it asks for the Python global {global_name}, which is not plain data "
        "(tensors, numpy arrays, numbers, strings, containers); impel never runs pickled code. If the file is yours, "
        "make the object's state_dict() return plain data, save again with Accelerate, and load that") from None


def sampler_epoch(path: Path) -> int | None:
    """The ``epoch`` of a pickled ``SeedableRandomSampler``, read from inert stand-ins (nothing is built)."""
    sampler = read_pickle(path, "dataloader sampler", inert=True)
    epoch = sampler.field("epoch") if hasattr(sampler, "field") else None
    if not isinstance(epoch, int):
        logger.warning("%s holds no sampler epoch (%r); the dataloader keeps its own", path, sampler)
        return None
    return epoch


def _restore_step(run: TrainingRun, step: int) -> None:
    """Accelerate's ``step`` counts micro-steps since the last dataloader end; it syncs when ``step % n == 0``."""
    state = run.gradient_state
    state.load_state_dict({"step": step, "micro_in_group": step % state.num_steps, "group_size": state.num_steps})


def restore_rng(state: dict[str, Any], device: torch.device, path: Path) -> None:
    """Python, numpy, torch and this device's CUDA generator from Accelerate's ``random_states_<rank>.pkl``."""
    try:
        random.setstate(state["random_state"])
        torch.set_rng_state(state["torch_manual_seed"])
        if "numpy_random_seed" in state:
            import numpy as np

            np.random.set_state(state["numpy_random_seed"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} holds malformed RNG states ({type(exc).__name__}: {exc})") from None
    cuda = state.get("torch_cuda_manual_seed")
    if cuda and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index < len(cuda):
            torch.cuda.set_rng_state(cuda[index], device)
    ignored = [key for key in _IGNORED_RNG if key in state]
    if ignored:
        logger.info("%s: %s not restored (accelerators impel does not drive)", path, ", ".join(ignored))
