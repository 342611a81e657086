"""Config files in Accelerate's YAML layout: load (with clear errors), save, and Accelerate's keys impel ignores.

A file written by ``accelerate config`` loads unchanged: besides the keys :class:`impel.config.run_config.RunConfig`
models,
Accelerate writes settings for hardware impel does not drive (TPUs, SageMaker, IPEX, Megatron-LM). Those load
when they hold their "off" value and raise otherwise, so nothing in a file is silently ignored. This module
never imports torch (``impel config show`` must stay fast).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from impel.config import environment as env
from impel.config.run_config import SECTIONS, ConfigError, RunConfig

# Accelerate keys that load only with their "off" value: key -> (values meaning off, what the key is for).
_OFF_NONE = (None, False, "", "no", "NO", "none", "None")
INERT_KEYS: dict[str, tuple[tuple[object, ...], str]] = {
    "downcast_bf16": (_OFF_NONE, "a TPU setting"),
    "tpu_env": (_OFF_NONE + ((),), "a TPU setting"),
    "tpu_use_cluster": (_OFF_NONE, "a TPU setting"),
    "tpu_use_sudo": (_OFF_NONE, "a TPU setting"),
    "tpu_name": (_OFF_NONE, "a TPU setting"),
    "tpu_zone": (_OFF_NONE, "a TPU setting"),
    "tpu_vm": (_OFF_NONE, "a TPU setting"),
    "commands": (_OFF_NONE, "a TPU pod setting"),
    "command_file": (_OFF_NONE, "a TPU pod setting"),
    "main_training_function": (_OFF_NONE + ("main",), "used by notebook launchers only"),
    "enable_cpu_affinity": (_OFF_NONE, "NUMA pinning, not supported"),
    "megatron_lm_config": (_OFF_NONE, "Megatron-LM, not supported"),
    "ipex_config": (_OFF_NONE, "Intel Extension for PyTorch, not supported"),
    "fp8_config": (_OFF_NONE, "FP8 training, not supported"),
    "use_mps_device": (_OFF_NONE, "MPS is picked automatically when present"),
}
_FSDP_RENAMED = {"fsdp_backward_prefetch_policy": "fsdp_backward_prefetch"}


def _is_off(value: object, off: tuple[object, ...]) -> bool:
    if isinstance(value, (dict, list)) and not value:
        return True
    if isinstance(value, dict):  # e.g. fp8_config: {fp8_backend: null}
        return all(_is_off(v, off) for v in value.values())
    return any(value is o or (type(value) is type(o) and value == o) for o in off)


def normalise_accelerate_keys(data: Mapping[str, Any], source: str) -> dict[str, object]:
    """Drop Accelerate's inert keys (raising when one is on) and fold its aliases into impel's keys."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in INERT_KEYS:
            off, why = INERT_KEYS[key]
            if not _is_off(value, off):
                raise ConfigError(f"{source}: {key}={value!r} is {why}; impel cannot honour it, so remove the key "
                                  "(or set it to its off value)")
            continue
        out[key] = value
    if "mpirun_config" in out:  # Accelerate's section of one key: impel's is top-level
        _fold_mpirun(out, source)
    if "dynamo_backend" in out:  # Accelerate's older layout: a top-level key, folded into the section as it does
        legacy = out.pop("dynamo_backend")
        if not _is_off(legacy, _OFF_NONE):
            out["dynamo_config"] = {"dynamo_backend": legacy, **(out.get("dynamo_config") or {})}
    fsdp = out.get("fsdp_config")
    if isinstance(fsdp, Mapping):
        out["fsdp_config"] = {_FSDP_RENAMED.get(k, k): v for k, v in fsdp.items()}
    ds = out.get("deepspeed_config")
    if isinstance(ds, Mapping):
        out["deepspeed_config"] = _normalise_deepspeed(dict(ds), out, source)
    if out.get("compute_environment") == "AMAZON_SAGEMAKER":
        raise ConfigError(f"{source}: compute_environment='AMAZON_SAGEMAKER' is not supported; run impel launch on "
                          "the machines themselves (compute_environment: LOCAL_MACHINE)")
    return out


def _fold_mpirun(out: dict[str, object], source: str) -> None:
    section = out.pop("mpirun_config")
    if section is None:
        return
    if not isinstance(section, Mapping) or set(section) - {"mpirun_hostfile"}:
        raise ConfigError(f"{source}: mpirun_config={section!r} must hold only mpirun_hostfile (as Accelerate's); "
                          "write mpirun_config: {mpirun_hostfile: FILE}, or mpirun_hostfile: FILE")
    hostfile = section.get("mpirun_hostfile")
    if hostfile is not None:
        if out.get("mpirun_hostfile") not in (None, hostfile):
            raise ConfigError(f"{source}: mpirun_config.mpirun_hostfile={hostfile!r} contradicts mpirun_hostfile="
                              f"{out['mpirun_hostfile']!r}; keep one")
        out["mpirun_hostfile"] = os.path.expanduser(str(hostfile))


def _normalise_deepspeed(ds: dict[str, object], top: dict[str, object], source: str) -> dict[str, object]:
    # Accelerate keeps the accumulation steps inside the section; impel has one top-level value.
    if "gradient_accumulation_steps" in ds:
        steps = ds.pop("gradient_accumulation_steps")
        if "gradient_accumulation_steps" in top and top["gradient_accumulation_steps"] != steps:
            raise ConfigError(f"{source}: deepspeed_config.gradient_accumulation_steps={steps!r} contradicts "
                              f"gradient_accumulation_steps={top['gradient_accumulation_steps']!r}; keep one")
        top["gradient_accumulation_steps"] = steps
    return ds


class DuplicateKey(Exception):
    """A mapping of a YAML file names the same key twice."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"{key!r} at lines {first} and {second}")
        self.key, self.first, self.second = key, first, second


def unique_key_loader() -> Any:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: object, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[object, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *anchor` merges: the keys beside it override them, as YAML means
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    if isinstance(key, (str, int, float, bool)) and key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_config_file(path: str) -> dict[str, object]:
    """The explicitly set keys of a YAML (or JSON) config file, validated; raises ConfigError naming the file."""
    data = load_config_mapping(path)
    try:
        return RunConfig.from_dict(data).to_dict(explicit_only=True)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_config_mapping(path: str) -> dict[str, object]:
    """A config file's keys in impel's names (Accelerate's older names mapped), not yet validated."""
    import yaml

    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory, not a file; pass the YAML file itself to "
                          "--config_file (impel config writes default_config.yaml)")
    if not os.path.exists(path):  # a device or a pipe (/dev/null, <(...)) is read like a file
        raise ConfigError(f"config file {path!r} does not exist; run `impel config` to write one or pass an "
                          "existing file to --config_file")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as exc:
        raise ConfigError(f"config file {path!r} sets {exc.key!r} twice (line {exc.first} and line {exc.second}); "
                          "keep one (YAML would silently take the last)") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path!r} is not valid YAML{at} ({problem}); fix the syntax or run "
                          "`impel config` to write a new one") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not a text file; pass a YAML config to --config_file") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys to values, not a "
                          f"{type(data).__name__}; see `impel config show` for the layout")
    return dict(normalise_accelerate_keys(data, path))


def file_document(explicit: Mapping[str, Any]) -> dict[str, object]:
    """What a config file holds: the explicit keys in a stable order, sections without unset (None) values."""
    order = [k for k in RunConfig.__dataclass_fields__ if k in explicit]
    doc: dict[str, Any] = {}
    for key in order:
        value = explicit[key]
        if key in SECTIONS:
            value = {k: v for k, v in value.items() if v is not None}
        doc[key] = value
    return doc


def write_config_file(explicit: Mapping[str, object], path: str) -> str:
    """Validate, then write atomically (a crash never leaves half a config)."""
    import yaml

    RunConfig.from_dict(explicit)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".impel-config-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            yaml.safe_dump(file_document(explicit), fh, sort_keys=False, default_flow_style=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def dump_yaml(data: Mapping[str, object]) -> str:
    import yaml

    return yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False)


def read_json_object(path: str | os.PathLike[str], name: str) -> dict[str, object]:
    """The JSON object in the file ``path``; a ConfigError naming ``name=path`` when the file is missing, is not
    JSON or holds something other than an object (the DeepSpeed JSON, the Trainer's dict knobs)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{name}={path!r} does not exist or is not a file; pass the path of a JSON file")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_unique_pairs)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}={path!r} is not valid JSON ({exc}); fix the file") from None
    except DuplicateKey as exc:
        raise ConfigError(f"{name}={path!r} sets {exc.key!r} twice in one object; keep one (JSON readers would "
                          "silently take the last)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name}={path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.load``'s object hook: a key given twice in one object raises :class:`DuplicateKey` (no lines known)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key, 0, 0)
        out[key] = value
    return out


class LoadedConfig(dict[str, Any]):
    """A config file's settings as :func:`load_config_from_file` returns them: a dict whose keys also read as
    attributes, with ``to_dict()`` (the shape of Accelerate's ``ClusterConfig``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the config file sets no {name!r}; its keys are {sorted(self)}") from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


def load_config_from_file(config_file: str | None) -> LoadedConfig:
    """Accelerate's ``load_config_from_file``: the settings of ``config_file`` (default: the file ``impel launch``
    reads, impel's or Accelerate's), validated; a missing file raises FileNotFoundError, as Accelerate's."""
    path = config_file if config_file is not None else env.config_to_read()[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist; pass an existing file or write one with "
                                "`impel config`")
    return LoadedConfig(read_config_file(path))
