"""impel's signatures against the installed Accelerate's, compared programmatically: every parameter Accelerate's
callable takes, impel's takes too (by name, in the same relative order, with the same default), for the names of
``impel.utils``, the Accelerator's and the state classes' methods, the Accelerator's constructor and
``impel.data_loader``. The differences left are listed below, each with its reason (docs/accelerate-compatibility.md
documents them); a new difference fails this test until it is fixed or listed."""
from __future__ import annotations

import inspect
from typing import Any

import pytest

accelerate = pytest.importorskip("accelerate")
import accelerate.data_loader as acc_dl  # noqa: E402
import accelerate.state as acc_state  # noqa: E402
import accelerate.utils as acc_utils  # noqa: E402

import impel.data_loader as dl  # noqa: E402
import impel.state as state  # noqa: E402
import impel.utils as iu  # noqa: E402
from impel.accelerator import Accelerator  # noqa: E402

ALLOWED = {
    # the value impel picks when left out depends on the device / the launched config (None = "not given")
    "InitProcessGroupKwargs: default backend": "None picks gloo on CPU and nccl on CUDA (Accelerate's 'nccl')",
    "GradientAccumulationPlugin: default num_steps": "1 (Accelerate's None raises when used)",
    "Accelerator.__init__: default split_batches": "None: DataLoaderConfiguration decides (Accelerate's sentinel)",
    "Accelerator.__init__: default gradient_accumulation_steps": "None: the launched config or 1",
    "Accelerator.__init__: default cpu": "None: the launched config or False",
    "is_mps_available: default min_version": "None asks for any MPS (Accelerate's '1.12' is a torch version)",
    # positional order: these are keyword arguments in practice (Accelerate's own docs pass them by name)
    "Accelerator.__init__: order": "impel's keywords after cpu are in another order; pass them by name",
    "FullyShardedDataParallelPlugin: order": "generated from the config's fields; pass them by name",
    # a decorator used as @accelerator.on_main_process: Accelerate's function=None form needs the Accelerator's
    # class name to contain "Accelerator" and is otherwise an error
    "Accelerator.on_main_process: default function": "decorator: the function is required",
    "Accelerator.on_local_main_process: default function": "decorator: the function is required",
    "PartialState.on_main_process: default function": "decorator: the function is required",
    "PartialState.on_local_main_process: default function": "decorator: the function is required",
}


def _same_default(a: Any, b: Any) -> bool:
    """Equal values; enum members by value; functions by name (each library has its own is_torch_tensor)."""
    a, b = getattr(a, "value", a), getattr(b, "value", b)
    if inspect.isfunction(a) and inspect.isfunction(b):
        return bool(a.__name__ == b.__name__)
    try:
        return bool(a == b) or (isinstance(a, type) and isinstance(b, type))
    except Exception:  # noqa: BLE001 (objects whose == raises)
        return a is b


def differences(label: str, mine: Any, theirs: Any) -> list[str]:
    try:
        ours, ref = inspect.signature(mine).parameters, inspect.signature(theirs).parameters
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.values())
    out = []
    for name, p in ref.items():
        if name in ("self", "cls") or p.kind in kinds:
            continue
        if name not in ours:
            if not takes_any:
                out.append(f"{label}: missing {name}")
        elif p.default is not inspect.Parameter.empty and not _same_default(ours[name].default, p.default):
            out.append(f"{label}: default {name}")
    positional = [n for n, p in ref.items() if n not in ("self", "cls") and p.kind not in kinds
                  and p.kind != inspect.Parameter.KEYWORD_ONLY]
    common = [n for n in positional if n in ours]
    if [n for n in ours if n in common] != common:
        out.append(f"{label}: order")
    return out


def _pairs() -> list[tuple[str, Any, Any]]:
    pairs = []
    for name in sorted(iu.SOURCES):
        if iu.SOURCES[name] == "impel.config.unsupported" or not callable(getattr(acc_utils, name, None)):
            continue
        pairs.append((name, getattr(iu, name), getattr(acc_utils, name)))
    for name in ("prepare_data_loader", "BatchSamplerShard", "IterableDatasetShard", "SkipBatchSampler",
                 "SkipDataLoader", "skip_first_batches", "DataLoaderShard", "DataLoaderDispatcher"):
        pairs.append((name, getattr(dl, name), getattr(acc_dl, name)))
    pairs.append(("Accelerator.__init__", Accelerator.__init__, accelerate.Accelerator.__init__))
    for cls_name, mine, theirs in (("Accelerator", Accelerator, accelerate.Accelerator),
                                   ("PartialState", state.PartialState, acc_state.PartialState),
                                   ("AcceleratorState", state.AcceleratorState, acc_state.AcceleratorState)):
        for name, member in vars(theirs).items():
            if name.startswith("_") and name != "_reset_state" or isinstance(member, property):
                continue
            if callable(getattr(theirs, name)):
                pairs.append((f"{cls_name}.{name}", getattr(mine, name, None), getattr(theirs, name)))
    return pairs


def test_signatures_match_accelerates_except_the_listed_differences():
    found = []
    pairs = _pairs()
    assert len(pairs) > 200
    for label, mine, theirs in pairs:
        if mine is None:
            cls, _, method = label.partition(".")
            found.append(f"{cls}: missing method {method}")
            continue
        found += differences(label, mine, theirs)
    unexplained = sorted(set(found) - set(ALLOWED))
    assert not unexplained
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale  # a difference fixed since: drop it from ALLOWED (and from the docs)
