"""The training state that is not model or optimizer weights: RNGs, counters, dataloaders, registered objects.

Everything here is plain data (tensors, numbers, strings, lists, dicts) so that it loads back with
``torch.load(weights_only=True)``. RNG states are per rank; the rest is identical on every rank and saved once.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from impel.checkpoint.store.layout import CheckpointError

if TYPE_CHECKING:
    from impel.runtime.loaders.prepared_loader import PreparedLoader
    from impel.runtime.step.accumulation import GradientState
    from impel.runtime.step.optimizer import AcceleratedOptimizer

logger = logging.getLogger("impel")


# --- RNG -------------------------------------------------------------------------------------------------------
def collect_rng_state(device: torch.device, dataloaders: Sequence[PreparedLoader] = ()) -> dict[str, object]:
    """This rank's python, numpy, torch and accelerator RNG states, and each dataloader's RNG state of its fetched
    but unused batch (``PreparedLoader.fetch_rng_state``: a collator that draws random masks resumes exactly)."""
    state: dict[str, object] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    fetches = [getattr(dl, "fetch_rng_state", lambda: None)() for dl in dataloaders]
    if any(f is not None for f in fetches):
        state["dataloader_fetch"] = fetches
    try:
        import numpy as np

        # legacy=True is the default, but numpy's stubs type the call without it as the dict form
        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # (name, key, pos, has_gauss, gauss): the global RandomState is MT19937
        _, key, pos, has_gauss, gauss = legacy
        state["numpy"] = {"key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps" and hasattr(torch, "mps"):
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device, dataloaders: Sequence[PreparedLoader] = ()) -> None:
    """Put back what :func:`collect_rng_state` returned (the dataloaders' positions restored first)."""
    for dl, fetch in zip(dataloaders, state.get("dataloader_fetch", [])):
        if hasattr(dl, "resume_fetch_rng"):
            dl.resume_fetch_rng(fetch)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        np.random.set_state(("MT19937", np_state["key"].numpy().astype("uint32"), np_state["pos"],
                             np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "mps" in state and device.type == "mps":
        torch.mps.set_rng_state(state["mps"])


# --- counters, dataloaders, precision ---------------------------------------------------------------------------
def collect_training_state(step: int, gradient_state: GradientState, optimizers: Sequence[AcceleratedOptimizer],
                           dataloaders: Sequence[PreparedLoader], precision: dict[str, object]) -> dict[str, object]:
    """Counters of the Accelerator and its prepared objects, dataloader positions and the GradScaler's state
    (``precision``, the strategy's ``precision_state_dict()``)."""
    return {
        "step": int(step),
        "gradient_state": gradient_state.state_dict(),
        "optimizers": [{"steps_taken": int(o.steps_taken), "step_was_skipped": bool(o.step_was_skipped)}
                       for o in optimizers],
        "dataloaders": [_with_batch(dl) for dl in dataloaders],
        "precision": precision,
    }


def restore_training_state(state: dict[str, Any], gradient_state: GradientState,
                           optimizers: Sequence[AcceleratedOptimizer], dataloaders: Sequence[PreparedLoader]) -> int:
    """Restore counters and dataloader positions (the precision state is loaded first, separately); return step."""
    gradient_state.load_state_dict(state["gradient_state"])
    for opt, counters in zip(optimizers, state["optimizers"]):
        opt.steps_taken = counters["steps_taken"]
        opt.step_was_skipped = counters["step_was_skipped"]
    for dl, dl_state in zip(dataloaders, state["dataloaders"]):
        dl.load_state_dict(_rescaled(dl, dl_state))
    return int(state["step"])


def _with_batch(loader: PreparedLoader) -> dict[str, object]:
    """A loader's state plus its global batch (samples per step over all ranks), so that a run on another world
    size finds the same place in the sample stream."""
    state = dict(loader.state_dict())
    total = getattr(loader, "total_batch_size", None)
    if isinstance(total, int) and "position" in state:
        state["global_batch"] = total
    return state


def _rescaled(loader: PreparedLoader, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` for ``loader`` when its global batch differs from the saving run's (another world size): the
    position that has consumed the same samples of the epoch's order; a CheckpointError when none does."""
    saved, now = state.get("global_batch"), getattr(loader, "total_batch_size", None)
    if saved is None or not isinstance(now, int) or saved == now or "position" not in state:
        return state
    samples = int(state["position"]) * int(saved)
    if samples % now:
        raise CheckpointError(f"the checkpoint's dataloader stopped after {samples} samples of its epoch "
                              f"({state['position']} global batches of {saved}), not a whole number of this run's "
                              f"global batches of {now} (another world size); resume on a world size whose global "
                              f"batch divides {samples}, or save at a step where it does")
    return dict(state, position=samples // now)


# --- registered objects -----------------------------------------------------------------------------------------
def describe(obj: object) -> str:
    """``module.Class`` of an object, for messages."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_registrable(objects: Sequence[object]) -> None:
    """Every object needs callable ``state_dict`` and ``load_state_dict``; a ValueError (as Accelerate's) naming
    each that lacks them ("Item at index N, its type, has no ...")."""
    bad = []
    for index, obj in enumerate(objects):
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            bad.append(f"Item at index {index}, {describe(obj)}, has no {' or '.join(m + '()' for m in missing)}")
    if bad:
        raise ValueError(f"register_for_checkpointing: {'; '.join(bad)}. Give each state_dict() and "
                         "load_state_dict(), or save it yourself in a register_save_state_pre_hook hook")
