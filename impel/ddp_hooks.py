"""DDP communication hooks (``DistributedDataParallelKwargs(comm_hook=...)``): Accelerate's names.

impel does not register comm hooks on its DDP models yet, so asking for one raises instead of training with plain
all-reduce while the user believes gradients are compressed.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from .config import ConfigError


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's DDP gradient-communication hooks (``no`` is plain all-reduce)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


def check_comm_hook(comm_hook: Any, comm_wrapper: Any, comm_state_option: Mapping[str, Any]) -> None:
    """Raise unless no hook, no wrapper and no hook state are asked for (impel does not wire them yet)."""
    for name, value in (("comm_hook", comm_hook), ("comm_wrapper", comm_wrapper)):
        try:
            kind = DDPCommunicationHookType(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in DDPCommunicationHookType)
            raise ConfigError(f"DistributedDataParallelKwargs({name}={value!r}) is not a DDP communication hook; "
                              f"use one of {allowed}") from None
        if kind is not DDPCommunicationHookType.NO:
            raise ConfigError(f"DistributedDataParallelKwargs({name}={kind.value!r}) is not supported yet: impel "
                              "does not register DDP communication hooks, so gradients would be all-reduced "
                              "uncompressed; drop the argument (or register the hook on the prepared model yourself "
                              "with model.register_comm_hook)")
    if comm_state_option:
        raise ConfigError(f"DistributedDataParallelKwargs(comm_state_option={dict(comm_state_option)!r}) configures a "
                          "comm hook, which impel does not register yet; drop it")
