"""Which submodules become their own FSDP2 unit (FSDP1's auto-wrap policies), and activation checkpointing.

FSDP2 has no auto-wrap: ``fully_shard`` is called on each unit, children before parents, then on the root. The
policies of FSDP1 / Accelerate pick those units:

- ``TRANSFORMER_BASED_WRAP``: every instance of the named layer classes (``fsdp_transformer_layer_cls_to_wrap``),
  or, when none are named, of the classes a transformers model lists in ``_no_split_modules``;
- ``SIZE_BASED_WRAP``: bottom-up, a module whose parameters not yet in a unit reach ``min_num_params``;
- ``NO_WRAP``: the root only;
- no policy: transformer layers when the model names them, else the root only.

A candidate that shares a parameter with a module outside it (tied embedding / lm_head) is left to its parent,
so a tied pair always lives in one unit.
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

from torch import nn

from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    from impel.config.run_config import FSDPConfig

logger = logging.getLogger("impel")

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def post_order(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before their parent (the order ``fully_shard`` must be called in)."""
    seen: set[int] = set()
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        out.append(module)

    visit(model)
    return out


def select_units(model: nn.Module, fsdp: FSDPConfig) -> tuple[list[nn.Module], set[str]]:
    """The submodules to shard as their own units (children first; the root excluded) and the layer class
    names that matched (to check explicitly named classes across all models of one ``prepare``)."""
    policy = fsdp.auto_wrap_policy
    if policy == "NO_WRAP":
        return [], set()
    if policy == "SIZE_BASED_WRAP":
        return _without_split_ties(model, _size_based(model, fsdp.min_num_params)), set()
    classes = layer_classes(model, fsdp.transformer_layer_cls_to_wrap, required=policy == "TRANSFORMER_BASED_WRAP")
    units = [m for m in post_order(model) if m is not model and type(m).__name__ in classes]
    return _without_split_ties(model, units), classes


def requested_names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def layer_classes(model: nn.Module, names: str | None, required: bool) -> set[str]:
    """Class names to wrap: the requested ones present in the model, else those detected from the model."""
    present = {type(m).__name__ for m in model.modules()}
    wanted = requested_names(names)
    if wanted:  # a name may match only some of the models of one prepare: check_requested checks them all
        return {n for n in wanted if n in present}
    detected = {n for n in _no_split_names(model) if n in present}
    if not detected and required:
        raise ConfigError(f"fsdp_auto_wrap_policy='TRANSFORMER_BASED_WRAP' but {type(model).__name__} does not name "
                          "its layer classes (no transformers `_no_split_modules` found); set "
                          f"fsdp_transformer_layer_cls_to_wrap to the repeated layer class, candidates: "
                          f"{candidate_text(model)}")
    return detected


def check_requested(names: str | None, models: list[nn.Module], matched: set[str]) -> None:
    """Every explicitly named layer class must occur in at least one of the prepared models."""
    missing = [n for n in requested_names(names) if n not in matched]
    if missing:
        candidates = "; ".join(f"{type(m).__name__}: {candidate_text(m)}" for m in models)
        raise ConfigError(f"fsdp_transformer_layer_cls_to_wrap={names!r}: {', '.join(missing)} is not a module class "
                          f"of the prepared model(s); candidates: {candidates}")


def _no_split_names(model: nn.Module) -> list[str]:
    names: list[str] = []
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.extend(str(n) for n in declared if str(n) not in names)
    return names


def candidate_text(model: nn.Module) -> str:
    """Classes that look like repeated layers: children of ModuleList/Sequential first, most frequent first."""
    stacked = collections.Counter(type(child).__name__ for m in model.modules()
                                  if isinstance(m, (nn.ModuleList, nn.Sequential)) for child in m.children())
    if not stacked:
        stacked = collections.Counter(type(m).__name__ for m in model.modules()
                                      if m is not model and not type(m).__module__.startswith("torch."))
    if not stacked:
        return "none (the model has no repeated submodules; use SIZE_BASED_WRAP or NO_WRAP)"
    return ", ".join(f"{name} (x{count})" for name, count in stacked.most_common(8))


def _size_based(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    chosen: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> int:  # parameters below this module that are in no unit yet
        if id(module) in seen:
            return 0
        seen.add(id(module))
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(visit(child) for child in module.children())
        if module is not model and count >= min_num_params and not isinstance(module, _CONTAINERS):
            chosen.append(module)
            return 0
        return count

    visit(model)
    return chosen


def _without_split_ties(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    owners: dict[int, list[nn.Module]] = collections.defaultdict(list)
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)].append(module)
    kept = []
    for unit in units:
        inside = {id(m) for m in unit.modules()}
        if all(id(o) in inside for p in unit.parameters() for o in owners[id(p)]):
            kept.append(unit)
        else:
            logger.info("FSDP: %s shares a parameter with a module outside it (tied weights); it stays in its "
                        "parent's unit", type(unit).__name__)
    return kept


def checkpoint_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Wrap each unit in torch's non-reentrant ``checkpoint_wrapper`` (in place in its parent); return the
    wrappers, which become the units. State-dict keys are unchanged (the wrapper strips its prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    if not units:
        raise ConfigError("fsdp_activation_checkpointing=true needs layers to checkpoint, but the wrap policy chose "
                          "none (root only); set fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP with "
                          "fsdp_transformer_layer_cls_to_wrap, or SIZE_BASED_WRAP")
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    wrapped = []
    for unit in units:
        parent, name = parents[id(unit)]
        wrapper = checkpoint_wrapper(unit)
        setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return wrapped
