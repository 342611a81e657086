"""Which of transformers' ``TrainingArguments`` fields and ``Trainer`` members hold on impel's Accelerator.

:class:`impel.trainer.hf.Trainer` is transformers' Trainer, so every field and member is transformers' own code.
The fields that reach Accelerate's plugins are plumbed into impel's: :data:`NOTES` says how (``fsdp`` /
``fsdp_config``: impel's FSDP2, :mod:`impel.trainer.hf_fsdp`; ``deepspeed``: impel's DeepSpeed,
:mod:`impel.trainer.hf_deepspeed`; ``parallelism_config``: impel's device mesh, its data-parallel sizes). Every
other field is transformers' behaviour, unchanged. ``docs/trainer.md``'s table is :func:`fields_table` (a test keeps
it current).

Example::

    print(fields_table())   # | `deepspeed` | impel's DeepSpeed strategy ... |
"""
from __future__ import annotations

import dataclasses
import inspect

# field -> what impel does with it (every other field is transformers' behaviour, unchanged)
NOTES: dict[str, str] = {
    "fsdp": "impel's FSDP2 plugin, built from transformers' `fsdp_plugin_args`; checkpoints in Accelerate's layout "
            "(impel.trainer.hf_fsdp); a PEFT model's checkpoint holds its adapters only (trainable parameters), as "
            "Accelerate's FSDP2 one",
    "fsdp_config": "impel's FSDP2 plugin (with `fsdp`); a key transformers drops under FSDP2 (FSDP1's "
                   "`forward_prefetch`, `use_orig_params`, ..., a typo) raises, naming it",
    "deepspeed": "impel's DeepSpeed strategy (ZeRO 0-3) with the JSON transformers filled; on a machine without "
                 "GPUs set `use_cpu=True`; `auto_find_batch_size` raises (impel.trainer.hf_deepspeed)",
    "parallelism_config": "impel's ParallelismConfig: `dp_replicate_size` / `dp_shard_size` (DDP, FSDP2, HSDP on "
                          "impel's device mesh); `tp_size`, `cp_size`, `sp_size` > 1 raise (not served on this "
                          "route: a custom loop on impel's Accelerator takes them)",
    "resume_from_checkpoint": "transformers' behaviour, plus `\"auto\"` (impel: the newest resumable checkpoint in "
                              "`output_dir`, from scratch when there is none); `True` takes the same one; nothing "
                              "impel did not write is removed (impel.trainer.hf_resume)",
    "use_cpu": "transformers' behaviour; several CPU ranks outside `impel launch` (which sets ACCELERATE_USE_CPU) "
               "need it (transformers counts processes through Accelerate's process state): a run where that count "
               "differs from impel's raises naming it",
}


def field_names() -> list[str]:
    """The installed transformers' ``TrainingArguments`` constructor fields, in its order."""
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init]


def member_names() -> list[str]:
    """The installed transformers' public ``Trainer`` members (methods and properties), sorted."""
    from transformers import Trainer

    return sorted(name for name, _ in inspect.getmembers(Trainer) if not name.startswith("_"))


def fields_table() -> str:
    """The Markdown table of every field: transformers' behaviour, or what impel does with it."""
    rows = ["| TrainingArguments field | on impel's Trainer (`impel.Trainer`) |", "|---|---|"]
    for name in field_names():
        note = NOTES.get(name, "transformers' behaviour")
        rows.append(f"| `{name}` | {note} |")
    return "\n".join(rows)


def members_line() -> str:
    """Every public Trainer member, one line (all are transformers' own code on impel's Accelerator)."""
    return ", ".join(f"`{name}`" for name in member_names())
