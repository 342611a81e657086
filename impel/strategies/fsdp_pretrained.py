"""``save_pretrained`` of a model sharded by FSDP2: refused with the form that works, not safetensors' error.

After ``fully_shard`` a model's parameters are ``DTensor`` shards. transformers' and PEFT's ``save_pretrained`` read
``model.state_dict()`` when no ``state_dict`` is given, and safetensors then fails deep inside ("Attempted to access
the data pointer on an invalid python storage"). Gathering the full state there would be a collective that hangs
when only the main process calls it, as scripts often do; so the sharded model's ``save_pretrained`` (an instance
attribute set at prepare; the class's method is untouched) raises naming Accelerate's recipe, which gathers on every
rank: ``save_pretrained(dir, is_main_process=..., state_dict=accelerator.get_state_dict(model))``.

Example::

    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained("out", is_main_process=accelerator.is_main_process,
                              state_dict=accelerator.get_state_dict(model))   # on every rank
"""
from __future__ import annotations

import functools
from typing import Any

from torch import nn

from impel.config.run_config import ConfigError


def guard_save_pretrained(model: nn.Module) -> None:
    """Give ``model`` (sharded by FSDP2) a ``save_pretrained`` that needs ``state_dict=`` (see the module)."""
    original = getattr(model, "save_pretrained", None)
    if not callable(original) or getattr(original, "_impel_guard", False):
        return

    name = next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))  # fully_shard's class

    @functools.wraps(original)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            raise ConfigError(f"{name}.save_pretrained(...) under FSDP2 without state_dict=: its "
                              "parameters are shards on each rank (safetensors cannot write them); gather them on "
                              "every rank and save on the main one: unwrap_model(model).save_pretrained(dir, "
                              "is_main_process=accelerator.is_main_process, "
                              "state_dict=accelerator.get_state_dict(model))")
        return original(*args, **kwargs)

    save_pretrained._impel_guard = True  # type: ignore[attr-defined]
    vars(model)["save_pretrained"] = save_pretrained  # an instance attribute: the class keeps its method
