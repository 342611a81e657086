"""The keyword arguments Accelerate's ``save_state`` / ``load_state`` take, checked and resolved.

``save_state(**save_model_func_kwargs)`` goes to DeepSpeed's ``engine.save_checkpoint`` (the only place Accelerate
uses it); ``load_state(load_kwargs=..., **load_model_func_kwargs)``: ``strict`` is the models' strictness (also
DeepSpeed's ``load_module_strict``), ``map_location`` is where loaded tensors are put before they are copied into
the prepared objects (impel always places them where those objects live, so any of Accelerate's values gives the
same result), other keys go to DeepSpeed's ``engine.load_checkpoint``. Anything that would have no effect raises.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from impel.config.run_config import ConfigError

# what impel itself passes to DeepSpeed's engine calls: a user value would break the checkpoint layout
_ENGINE_SAVE_OWNED = ("tag", "client_state", "save_latest")
_ENGINE_LOAD_OWNED = ("tag", "load_lr_scheduler_states")
_MAP_LOCATIONS = (None, "cpu", "on_device")


@dataclass(frozen=True)
class SaveOptions:
    engine_kwargs: Mapping[str, object] = field(default_factory=dict)  # DeepSpeed's save_checkpoint
    shared_dir: bool = True  # every rank writes into the same directory (False: save_on_each_node)


@dataclass(frozen=True)
class LoadOptions:
    strict: bool = True
    engine_kwargs: Mapping[str, object] = field(default_factory=dict)  # DeepSpeed's load_checkpoint


# the defaults of the ``options`` parameters (frozen, so one shared instance is safe)
DEFAULT_SAVE = SaveOptions()
DEFAULT_LOAD = LoadOptions()


def save_options(kwargs: Mapping[str, object], deepspeed: bool) -> SaveOptions:
    if not kwargs:
        return SaveOptions()
    if not deepspeed:
        raise ConfigError(f"save_state({_show(kwargs)}): Accelerate passes extra save_state arguments to "
                          "DeepSpeed's engine.save_checkpoint only, so they would do nothing here; drop them")
    owned = sorted(set(kwargs) & set(_ENGINE_SAVE_OWNED))
    if owned:
        raise ConfigError(f"save_state({_show({k: kwargs[k] for k in owned})}): impel sets "
                          f"{', '.join(owned)} itself (the checkpoint's layout depends on them); drop them")
    return SaveOptions(dict(kwargs))


def load_options(load_kwargs: Mapping[str, object] | None, kwargs: Mapping[str, object],
                 deepspeed: bool) -> LoadOptions:
    for key, value in (load_kwargs or {}).items():
        if key == "map_location":
            _check_map_location(value, "load_kwargs")
        elif key == "weights_only" and value is True:
            pass
        elif key == "weights_only":
            raise ConfigError(f"load_state(load_kwargs={{'weights_only': {value!r}}}): impel never unpickles "
                              "checkpoint files with code execution; drop it")
        else:
            raise ConfigError(f"load_state(load_kwargs={{{key!r}: ...}}) is not supported: impel reads every file "
                              "itself (safely, onto the CPU); load_kwargs takes only map_location")
    rest = dict(kwargs)
    _check_map_location(rest.pop("map_location", None), "map_location")
    strict = rest.pop("strict", True)
    if not isinstance(strict, bool):
        raise ConfigError(f"load_state(strict={strict!r}) must be True or False")
    if rest and not deepspeed:
        raise ConfigError(f"load_state({_show(rest)}) is not supported: besides strict and map_location, Accelerate "
                          "passes extra arguments to DeepSpeed's engine.load_checkpoint only; drop them")
    owned = sorted(set(rest) & set(_ENGINE_LOAD_OWNED))
    if owned:
        raise ConfigError(f"load_state({_show({k: rest[k] for k in owned})}): impel sets {', '.join(owned)} itself "
                          "(schedulers are restored by impel); drop them")
    if deepspeed:
        rest.setdefault("load_module_strict", strict)
    return LoadOptions(strict=strict, engine_kwargs=rest)


def _check_map_location(value: object, where: str) -> None:
    if value not in _MAP_LOCATIONS:
        raise ConfigError(f"load_state({where}={value!r}) must be None, 'cpu' or 'on_device' (Accelerate's values); "
                          "impel reads onto the CPU and copies into the prepared objects wherever they live")


def _show(kwargs: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
