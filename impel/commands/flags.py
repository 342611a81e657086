"""Launch flags derived from the config dataclasses (never written twice), and the file < flag resolution.

Every field of :class:`impel.config.run_config.RunConfig` and of its sections becomes a flag named as Accelerate names
it:
``--mixed_precision``, ``--cpu`` (``use_cpu``), ``--fsdp_sharding_strategy``, ``--zero_stage``. Accelerate's
shortcuts ``--multi_gpu``, ``--use_fsdp`` and ``--use_deepspeed`` set ``distributed_type``. Flags that are not
given do not exist in the result, so a flag beats the file and an absent flag leaves the file's value.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from impel.config.run_config import FALSE_WORDS, SECTIONS, TRUE_WORDS, ConfigError, RunConfig, coerce

_SHORTCUTS = {"multi_gpu": "MULTI_GPU", "use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED", "use_auto": "AUTO"}
_DEST = "cfg__"  # namespace attribute prefix: cfg__<section>__<key>
_BOOL_WORDS = set(TRUE_WORDS) | set(FALSE_WORDS)


def config_fields() -> Iterator[tuple[str | None, str, str, Any]]:
    """(section or None, YAML key, flag name, field metadata) for every config field."""
    for f in fields(RunConfig):
        if f.name in SECTIONS:
            cls = SECTIONS[f.name]
            for sub in fields(cls):
                key = cls.PREFIX + sub.name
                yield f.name, key, key, sub.metadata
        else:
            yield None, f.name, f.metadata.get("flag") or f.name, f.metadata


def _metavar(meta: Any) -> str:
    if meta["choices"] is not None:
        return "{" + ",".join(str(c) for c in meta["choices"]) + "}"
    return {"bool": "BOOL", "int": "INT", "float": "NUM", "str": "TEXT"}[meta["kind"]]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups = {None: parser.add_argument_group("run config (flag > --config_file > defaults)"),
              "fsdp_config": parser.add_argument_group("FSDP (with --use_fsdp)"),
              "deepspeed_config": parser.add_argument_group("DeepSpeed (with --use_deepspeed)"),
              "dynamo_config": parser.add_argument_group(
            "torch.compile of prepared models (impel.runtime.step.compile)"),
              "parallelism_config": parser.add_argument_group("N-D parallelism (ParallelismConfig: device mesh sizes)")}
    groups[None].add_argument("--config_file", default=None, metavar="FILE",
                              help="YAML config (default: $IMPEL_CONFIG_FILE or ~/.cache/impel/default_config.yaml)")
    for flag, kind in list(_SHORTCUTS.items())[:3]:  # --use_auto is spelled --strategy auto
        groups[None].add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS,
                                  help=f"distributed_type: {kind}")
    groups[None].add_argument("--strategy", choices=("auto",), default=argparse.SUPPRESS,
                              help="auto: pick the cheapest strategy that fits from a memory estimate of "
                                   "--auto_model (distributed_type: AUTO)")
    groups["parallelism_config"].add_argument(
        "--use_parallelism_config", action="store_true", default=argparse.SUPPRESS,
        help="Accelerator() builds a ParallelismConfig (ranks get ACCELERATE_USE_PARALLELISM_CONFIG=true, as from "
             "accelerate launch): sizes from the parallelism_config_* flags or the YAML section, else every rank "
             "data parallel, as Accelerate's default ParallelismConfig()")
    for section, key, flag, meta in config_fields():
        # a bool flag alone means true; `--flag false` is joined into `--flag=false` by bool_values_joined
        groups[section].add_argument(f"--{flag}", dest=f"{_DEST}{section or ''}__{key}", default=argparse.SUPPRESS,
                                     metavar=_metavar(meta), help=meta["help"])


def add_field_flag(parser: argparse.ArgumentParser, name: str, **overrides: Any) -> None:
    """One top-level config field as a plain flag of another command (``impel config default --mixed_precision``),
    with the field's flag name, choices and help; ``overrides`` are argparse's (``default=...``)."""
    meta = next(f.metadata for f in fields(RunConfig) if f.name == name)
    options: dict[str, object] = {"choices": meta["choices"], "help": meta["help"], "dest": name}
    if meta["kind"] in ("int", "float"):
        options["type"] = int if meta["kind"] == "int" else float
    parser.add_argument(f"--{meta['flag'] or name}", **{**options, **overrides})


def bool_values_joined(argv: list[str], valued_flags: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Accelerate's bool flags work alone (``--cpu``) or with a value (``--fsdp_offload_params false``).

    argparse cannot take an optional value without eating the script name that may follow, so before parsing
    each bool flag becomes ``--flag=VALUE`` (or ``--flag=true``). Only the tokens before the script are touched:
    the subcommand is the first positional token, the script the second. ``valued_flags``: the commands' other
    flags that take a value (``--nnodes 1:2``, ``--tee 3``), whose value is not the script.
    """
    bools = {f"--{flag}": {str(a) for a in meta["aliases"]} for _, _, flag, meta in config_fields()
             if meta["kind"] == "bool"}  # with the words a bool takes besides true/false (FULL_SHARD)
    valued = {f"--{flag}" for _, _, flag, meta in config_fields() if meta["kind"] != "bool"}
    valued |= {"--config_file", *valued_flags}
    out: list[str] = []
    positionals = 0
    i = 0
    while i < len(argv):
        token = underscored(argv[i])
        if token == "--" or (not token.startswith("-") and positionals == 1):
            return out + argv[i:]
        if token in bools:
            after = argv[i + 1] if i + 1 < len(argv) else ""
            joined = after.lower() in _BOOL_WORDS or after in bools[token]
            out.append(f"{token}={after if joined else 'true'}")
            i += 2 if joined else 1
            continue
        if token in valued:
            out += [token, *argv[i + 1:i + 2]]
            i += 2
            continue
        positionals += not token.startswith("-")
        out.append(token)
        i += 1
    return out


def underscored(token: str) -> str:
    """``--mixed-precision=bf16`` -> ``--mixed_precision=bf16``: Accelerate accepts both spellings of its flags."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


def explicit_from_flags(ns: argparse.Namespace) -> dict[str, object]:
    """The config keys given as flags, converted from text and checked one by one."""
    metas = {(s, k): (flag, m) for s, k, flag, m in config_fields()}
    out: dict[str, Any] = {}
    for attr, raw in vars(ns).items():
        if not attr.startswith(_DEST):
            continue
        section, key = attr[len(_DEST):].split("__", 1)
        flag, meta = metas[(section or None, key)]
        value = coerce(f"--{flag}", raw, meta, from_text=True)
        if section:
            out.setdefault(section, {})[key] = value
        else:
            out[key] = value
    if getattr(ns, "strategy", None) == "auto":
        ns.use_auto = True
    shortcuts = [flag for flag in _SHORTCUTS if getattr(ns, flag, False)]
    if len(shortcuts) > 1:
        shown = ["--strategy auto" if s == "use_auto" else "--" + s for s in shortcuts]
        raise ConfigError(f"{' and '.join(shown)} were both given; pick one strategy")
    if shortcuts:
        kind = _SHORTCUTS[shortcuts[0]]
        if out.get("distributed_type", kind) != kind:
            raise ConfigError(f"--{shortcuts[0]} contradicts --distributed_type {out['distributed_type']}; "
                              "pass one of them")
        out["distributed_type"] = kind
    return out


def merge_file_and_flags(from_file: dict[str, object],
                         from_flags: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """Flags over file, key by key (sections too). Returns the merged keys and notes to show the user.

    When a flag switches the strategy away from the file's, the file's section for the old strategy no longer
    applies; it is dropped with a note rather than raising, so ``--use_deepspeed`` works over an FSDP file.
    """
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in from_file.items()}
    notes: list[str] = []
    new_kind = from_flags.get("distributed_type")
    if new_kind is not None and new_kind != from_file.get("distributed_type"):
        for section, owner in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
            if section in merged and owner != new_kind:
                notes.append(f"distributed_type {new_kind} from the flags replaces the file's "
                             f"{from_file.get('distributed_type')}: its {section} is not used")
                del merged[section]
    for key, value in from_flags.items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
        else:
            merged[key] = value
    return merged, notes


def explicit_from_flags_list(argv: list[str]) -> dict[str, object]:
    """The config keys a list of launch flags sets (``["--use_fsdp", "--fsdp_offload_params"]``)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_config_flags(parser)
    return explicit_from_flags(parser.parse_args(bool_values_joined(["launch", *argv])[1:]))
