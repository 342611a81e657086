"""Which of transformers' ``TrainingArguments`` fields and ``Trainer`` members hold on impel's Accelerator.

:class:`impel.trainer.hf.Trainer` is transformers' Trainer, so every field and member is transformers' own code;
the ones that reach Accelerate's DeepSpeed / parallelism paths (which transformers drives with Accelerate's own
``DeepSpeedPlugin`` and ``ParallelismConfig`` objects, not through the Accelerator) are not served by impel yet: set
to anything but their default, they raise with the reason. ``fsdp`` / ``fsdp_config`` build impel's FSDP2 plugin
(checkpoints: :mod:`impel.trainer.hf_fsdp`). ``docs/trainer.md``'s table is :func:`fields_table` (a test keeps it
current).

Example::

    check_supported(TrainingArguments(output_dir="out", deepspeed="ds.json"))  # ConfigError naming the fix
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from impel.config.run_config import ConfigError

_IMPEL_TRAINER = ("use impel's own Trainer (`from impel import Trainer, TrainingArguments`), which plumbs this knob "
                  "into impel's Accelerator")

# field -> why it raises when set; every other field is transformers' behaviour, unchanged
UNSUPPORTED: dict[str, str] = {
    "deepspeed": "transformers builds Accelerate's DeepSpeedPlugin and reads Accelerate's state; "
                 f"{_IMPEL_TRAINER}",
    "parallelism_config": "transformers passes an Accelerate ParallelismConfig object to the Accelerator; pass "
                          "impel's ParallelismConfig to impel's Accelerator in a custom loop",
}


def _is_set(args: Any, name: str) -> bool:
    value = getattr(args, name)
    return value not in (None, "", [], {}, False)


def check_supported(args: Any) -> None:
    """Raise a ConfigError for the first field of :data:`UNSUPPORTED` that is set."""
    for name, reason in UNSUPPORTED.items():
        if _is_set(args, name):
            raise ConfigError(f"TrainingArguments({name}={getattr(args, name)!r}) on impel.trainer.hf.Trainer "
                              f"(transformers' Trainer on impel's Accelerator): {reason}")


def field_names() -> list[str]:
    """The installed transformers' ``TrainingArguments`` constructor fields, in its order."""
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init]


def member_names() -> list[str]:
    """The installed transformers' public ``Trainer`` members (methods and properties), sorted."""
    from transformers import Trainer

    return sorted(name for name, _ in inspect.getmembers(Trainer) if not name.startswith("_"))


def fields_table() -> str:
    """The Markdown table of every field: transformers' behaviour, or the reason it raises."""
    rows = ["| TrainingArguments field | on impel.trainer.hf.Trainer |", "|---|---|"]
    for name in field_names():
        reason = UNSUPPORTED.get(name)
        rows.append(f"| `{name}` | " + (f"raises when set: {reason}" if reason else "transformers' behaviour") + " |")
    return "\n".join(rows)


def members_line() -> str:
    """Every public Trainer member, one line (all are transformers' own code on impel's Accelerator)."""
    return ", ".join(f"`{name}`" for name in member_names())
