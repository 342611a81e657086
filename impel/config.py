"""The run config: typed dataclasses, validation with clear messages, and the one-way merge.

Precedence: defaults < YAML file < launch flags < arguments in code. ``impel launch`` resolves the first three and
exports the result as JSON (see :mod:`impel.env`); the Accelerator merges its own arguments on top and raises when
one contradicts a launched value. Key names are Accelerate's, so its config files load unchanged.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping

class DistributedType(str, enum.Enum):
    """How the run is distributed; members compare equal to their names (``DistributedType.FSDP == "FSDP"``)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"

    def __str__(self) -> str:
        return self.value


DISTRIBUTED_TYPES = tuple(t.value for t in DistributedType)
MIXED_PRECISIONS = ("no", "fp16", "bf16")


class ConfigError(ValueError):
    """A config value is wrong; the message names the value and the fix."""


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name}={value!r} is not allowed; use one of {allowed}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def did_you_mean(key: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass
class RunConfig:
    """Everything a rank needs to know about the run (the core fields; strategy sections plug in later)."""

    distributed_type: str | None = field(default=None, metadata={"choices": DISTRIBUTED_TYPES,
                                          "help": "how to distribute; None picks NO, MULTI_CPU or MULTI_GPU"})
    mixed_precision: str = field(default="no", metadata={"choices": MIXED_PRECISIONS,
                                                          "help": "autocast dtype for the forward pass"})
    gradient_accumulation_steps: int = field(default=1, metadata={"min": 1,
                                                                  "help": "micro-steps per optimizer step"})
    use_cpu: bool = field(default=False, metadata={"help": "train on the CPU even when a GPU is present"})
    num_processes: int | None = field(default=None, metadata={"min": 1, "help": "total number of ranks"})

    def validate(self) -> "RunConfig":
        if self.distributed_type is not None:
            _choice("distributed_type", self.distributed_type, DISTRIBUTED_TYPES)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        if not isinstance(self.use_cpu, bool):
            raise ConfigError(f"use_cpu={self.use_cpu!r} must be true or false")
        if self.num_processes is not None:
            _positive_int("num_processes", self.num_processes)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, known)}")
        return cls(**dict(data)).validate()


def defaults() -> dict[str, Any]:
    return {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}


def merge_code_arguments(launched: Mapping[str, Any] | None, code: Mapping[str, Any]) -> RunConfig:
    """Put the Accelerator's own arguments (None = not given) on top of the launched config.

    A code argument that contradicts a value the launcher set raises, naming both: a script that hard-codes
    ``mixed_precision="fp16"`` launched with ``--mixed_precision bf16`` is ambiguous, and guessing loses data.
    """
    base = dict(launched or {})  # unknown launched keys fail in from_dict, with a did-you-mean
    for key, value in code.items():
        if value is None:
            continue
        if base.get(key) is not None and base[key] != value:
            raise ConfigError(
                f"Accelerator({key}={value!r}) contradicts the launched config ({key}={base[key]!r}); "
                f"remove the argument from the code or change the launch flag / config file")
        base[key] = value
    return RunConfig.from_dict(base)
