"""Model and optimizer state as full files: what the base Strategy (single device, DDP) writes.

State dicts come from ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict``), so keys are fully qualified parameter names without wrapper prefixes
(``module.`` of DDP) and optimizer state is keyed by parameter name, not by position: the same files load under
DDP, FSDP2 (which can pass ``StateDictOptions(full_state_dict=True, ...)``) or one process.

Files: ``model.safetensors`` (``model_1.safetensors`` ... for more models; ``pytorch_model.bin`` with
``safe_serialization=False``) and ``optimizer.pt`` (``optimizer_1.pt`` ...).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from impel.checkpoint import formats
from impel.checkpoint.formats import cooperative, full_slices, named_state
from impel.checkpoint.io.files import (
    read_safetensors,
    read_safetensors_file,
    read_torch,
    write_safetensors,
    write_torch,
)
from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.nn.modules.module import _IncompatibleKeys

    from impel.checkpoint.io.verified import Manifest
    from impel.checkpoint.saving.session import SaveSession

logger = logging.getLogger(__name__)

FORMAT = formats.FULL.name


def suffix(index: int) -> str:
    """'' for the first object, '_1', '_2', ... after it (Accelerate's convention)."""
    return "" if index == 0 else f"_{index}"


def model_file(index: int, safe_serialization: bool) -> str:
    return f"model{suffix(index)}.safetensors" if safe_serialization else f"pytorch_model{suffix(index)}.bin"


def optimizer_file(index: int, cooperative: bool = False) -> str:
    return f"optimizer{suffix(index)}.safetensors" if cooperative else f"optimizer{suffix(index)}.pt"


def pair_optimizers(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> list[int]:
    """For each optimizer, the index of the model that owns all its parameters."""
    from impel.runtime.step.optimizer import optimizer_owners

    owners: list[int] = []
    for i, (opt, owner) in enumerate(zip(optimizers, optimizer_owners(models, optimizers))):
        if owner is None:
            raise CheckpointError(f"optimizer {i} ({type(opt).__name__}) has parameters that no single prepared "
                                  "model owns; prepare the model(s) with accelerator.prepare, one optimizer per model")
        owners.append(owner)
    return owners


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name; an optimizer that never stepped stays untouched."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    if options is None and not fresh:  # the names recorded at the first save (torch's answer, without its cost)
        return named_state.optimizer_state(model, optimizer)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if fresh:
        # get_optimizer_state_dict initialises empty state with a zero-lr step (Adam's step becomes 1); undo it so
        # that saving before the first step does not change the run.
        optimizer.state.clear()
        state["state"] = {}
    return state


def save_full(session: SaveSession, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
              safe_serialization: bool, skip_models: AbstractSet[int] = frozenset(),
              options: StateDictOptions | None = None, all_ranks: bool = False,
              cooperative_rank: int | None = None) -> Mapping[str, object]:
    """Write full model and optimizer files into ``session.directory``; returns the strategy section of the
    checkpoint metadata.

    ``session.leader``: this rank writes. ``all_ranks``: every rank must take part in building the state dicts (sharded
    models gathered with ``options``); otherwise only writers build them (replicated models, like DDP).
    ``cooperative_rank`` (sharded models, one shared directory): this rank's global rank; every rank writes its
    own shards into the full files instead of gathering them on the writer (``checkpoint/formats/cooperative.py``).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory, writer = session.checkpoint_dir, session.leader
    names = {"models": [model_file(i, safe_serialization) for i in range(len(models))],
             "optimizers": [optimizer_file(i) for i in range(len(optimizers))]}
    if not (writer or all_ranks):
        return {"format": FORMAT, **names}
    shared: list[tuple[dict[str, torch.Tensor], Path, dict[str, str]]] = []  # cooperative files, written at the end
    for i, model in enumerate(models):
        if i in skip_models:
            continue
        if cooperative_rank is not None and safe_serialization:
            shards = cast(dict[str, torch.Tensor], named_state.model_state(model))  # DTensors: this rank's shards
            shared.append((shards, directory / names["models"][i], {}))
            continue
        # full: tensors only (replicated models, options None: torch's names, recorded at the first save)
        weights = cast(dict[str, torch.Tensor], named_state.model_state(model) if options is None
                       else get_model_state_dict(model, options=options))
        if writer:
            _write_weights(session, weights, directory / names["models"][i], safe_serialization)
    for i, (opt, owner) in enumerate(zip(optimizers, pair_optimizers(models, optimizers))):
        coop = cooperative_rank is not None
        packed = cooperative.optimizer_tensors(optimizer_state(models[owner], opt)) if coop else None
        if packed is not None and cooperative_rank is not None:  # the same answer on every rank (same structure)
            names["optimizers"][i] = optimizer_file(i, cooperative=True)
            shared.append((packed[0], directory / names["optimizers"][i], packed[1]))
            continue
        state = optimizer_state(models[owner], opt, options)
        if writer:
            write_torch(session, state, directory / names["optimizers"][i])
    if shared and cooperative_rank is not None:
        # this rank's share of the full files (their lengths reserved before the first write), now or staged
        session.write(cooperative.write_files, shared, cooperative_rank)
    return {"format": FORMAT, **names}


def read_optimizer(manifest: Manifest | None, path: Path, what: str) -> Any:
    """A full optimizer state dict from ``optimizer*.pt`` or a cooperatively written ``optimizer*.safetensors``."""
    if path.suffix != ".safetensors":
        return read_torch(manifest, path, what)
    tensors, metadata = read_safetensors_file(manifest, path, what)
    try:
        return cooperative.optimizer_state_from(tensors, metadata)
    except Exception as exc:  # noqa: BLE001 - a bad layout raises KeyError / ValueError / json's errors
        raise CheckpointError(f"checkpoint file {path} ({what}) is not a valid optimizer file ({exc}); it is "
                              "truncated or corrupted: load an earlier checkpoint") from None


def _write_weights(session: SaveSession, state: Mapping[str, torch.Tensor], path: Path,
                   safe_serialization: bool) -> None:
    if safe_serialization:
        write_safetensors(session, state, path)
    else:
        write_torch(session, {k: v.detach().cpu() for k, v in state.items()}, path)


def read_weights(manifest: Manifest | None, path: Path) -> dict[str, torch.Tensor]:
    """A full model state dict from ``model*.safetensors`` or ``pytorch_model*.bin`` (loaded safely), checked
    against ``manifest`` as it is read."""
    if path.suffix == ".safetensors":
        return read_safetensors(manifest, path, "model weights")
    return read_torch(manifest, path, "model weights")


def load_full(manifest: Manifest | None, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
              directory: Path,
              metadata: Mapping[str, Any], *, skip_models: AbstractSet[int] = frozenset(),
              options: StateDictOptions | None = None, slices: bool = False) -> None:
    """Load what :func:`save_full` wrote into the prepared models and optimizers (on every rank).

    ``slices`` (sharded models): each rank reads only its own shards' bytes of the safetensors files
    (``full_slices``) instead of the whole state, which torch would then scatter from rank 0."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{directory} holds a {metadata.get('format')!r} checkpoint, which this strategy "
                              f"cannot load (it reads {FORMAT!r}); resume with the strategy that saved it, or "
                              "convert it with merge_weights")
    for i, model in enumerate(models):
        if i in skip_models:
            continue
        path = directory / metadata["models"][i]
        if slices and path.suffix == ".safetensors":
            check = _fits(model, i, path, strict=getattr(options, "strict", True))
            _warn_not_strict(full_slices.load_model(manifest, model, path, options, check), path, i)
            continue
        state = read_weights(manifest, path)
        try:
            # torch types the argument as the invariant dict[str, ValueType], which a dict[str, Tensor] is not
            result = set_model_state_dict(model, state, options=options)  # type: ignore[arg-type]
        except (RuntimeError, KeyError, ValueError) as exc:
            why = first_mismatch(model, state) or str(exc)
            raise CheckpointError(f"{directory / metadata['models'][i]} does not fit prepared model {i} "
                                  f"({type(model).__name__}): {why}; load it into the model it was saved "
                                  "from") from None
        _warn_not_strict(result, path, i)
    for i, (opt, owner) in enumerate(zip(optimizers, pair_optimizers(models, optimizers))):
        path = directory / metadata["optimizers"][i]
        if slices and path.suffix == ".safetensors" and full_slices.load_optimizer(manifest, models[owner], opt, path,
                                                                                  options):
            continue
        state = read_optimizer(manifest, path, f"optimizer {i}")
        if not state.get("state"):
            _load_fresh_optimizer(opt, state)
            continue
        set_optimizer_state_dict(models[owner], opt, state, options=options)


def _fits(model: nn.Module, index: int, path: Path, strict: bool) -> Callable[[Mapping[str, tuple[int, ...]]], None]:
    """The check of a full file's names and shapes against a model, before any byte is read (``full_slices``): a
    shape that differs raises, and under ``strict`` a name missing or extra; the message is the gathered path's."""
    def check(shapes: Mapping[str, tuple[int, ...]]) -> None:
        state = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        why = first_mismatch(model, state)
        own = getattr(model, "module", model).state_dict(keep_vars=True)
        differs = any(name in state and state[name].shape != t.shape for name, t in own.items())
        if why is not None and (strict or differs):
            raise CheckpointError(f"{path} does not fit prepared model {index} ({type(model).__name__}): {why}; "
                                  "load it into the model it was saved from")
    return check


def _warn_not_strict(result: _IncompatibleKeys | None, path: Path, index: int) -> None:
    if result is not None and (result.missing_keys or result.unexpected_keys):  # load_state(strict=False)
        logger.warning("%s loaded into model %d with strict=False: missing %s, unexpected %s", path, index,
                       list(result.missing_keys), list(result.unexpected_keys))


def first_mismatch(model: nn.Module, state: Mapping[str, torch.Tensor]) -> str | None:
    """The first parameter whose name or shape differs between a model and a full state dict, with both shapes."""
    inner = getattr(model, "module", model)
    own = {name: tuple(t.shape) for name, t in inner.state_dict(keep_vars=True).items()}
    problems = []
    for name, shape in own.items():
        if name not in state:
            problems.append(f"parameter {name!r} (shape {list(shape)}) is missing from the checkpoint")
        elif tuple(state[name].shape) != shape:
            problems.append(f"parameter {name!r} has shape {list(state[name].shape)} in the checkpoint but "
                            f"{list(shape)} in the model")
    problems += [f"the checkpoint has {name!r}, which the model does not" for name in state if name not in own]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
    return problems[0] + more


def _load_fresh_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """An optimizer saved before its first step: restore hyper-parameters, keep the state empty."""
    groups = state.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups but the prepared "
                              f"one has {len(optimizer.param_groups)}; build the optimizer the same way")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
