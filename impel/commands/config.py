"""``impel config`` (questionnaire), ``config default``, ``config show`` and ``config validate``.

``config show`` and ``config validate`` never import torch; ``config default`` does, to count GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys

from impel.commands.flags import add_field_flag
from impel.config import environment as env
from impel.config.elastic import check_elastic_launch
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import LoadedConfig as LoadedConfig  # re-exported: Accelerate's accelerate.commands.config
from impel.config.yaml_file import dump_yaml, file_document, load_config_mapping, read_config_file, write_config_file
from impel.config.yaml_file import load_config_from_file as load_config_from_file

# Accelerate's ``accelerate.commands.config.default_config_file``: the file ``impel config`` writes
default_config_file = env.default_config_path()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("config", help="write, show or check the default config file",
                              description="Without a subcommand: answer questions (from a terminal or piped "
                                          "on stdin) and write the config file.")
    p.add_argument("--config_file", default=None, metavar="FILE", help="where to write (default: "
                   "$IMPEL_CONFIG_FILE or ~/.cache/impel/default_config.yaml)")
    p.set_defaults(handler=questionnaire)
    sub = p.add_subparsers(dest="config_command", metavar="{default,show,validate,convert}")
    d = sub.add_parser("default", help="write a config for the hardware this machine has, asking nothing")
    d.add_argument("--config_file", default=argparse.SUPPRESS, metavar="FILE")
    add_field_flag(d, "mixed_precision", default=None)
    d.add_argument("--overwrite", action="store_true", help="replace an existing file")
    d.set_defaults(handler=write_default)
    s = sub.add_parser("show", help="print the config file and the resolved config")
    s.add_argument("--config_file", default=argparse.SUPPRESS, metavar="FILE")
    s.set_defaults(handler=show)
    v = sub.add_parser("validate", help="check a config file and exit 0 (valid) or 2 (invalid)")
    v.add_argument("file", metavar="FILE")
    v.set_defaults(handler=validate)
    c = sub.add_parser("convert", help="translate an FSDP config to DeepSpeed or back, with a note per difference")
    c.add_argument("--to", required=True, choices=("deepspeed", "fsdp"), help="the strategy to translate to")
    c.add_argument("file", metavar="FILE")
    c.add_argument("-o", "--output", default=None, metavar="OUT", help="write here (default: print it)")
    c.set_defaults(handler=convert_file)


def _path(ns: argparse.Namespace) -> str:
    return getattr(ns, "config_file", None) or env.config_path_to_write()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def questionnaire(ns: argparse.Namespace) -> int:
    from impel.commands.questionnaire import Prompter, run_questionnaire

    def default_processes(kind: str) -> int:
        return 2 if kind == "MULTI_CPU" else max(_gpu_count(), 1)

    answers = run_questionnaire(Prompter(), default_processes)
    path = write_config_file(answers, _path(ns))
    print(f"\nWrote {path}:\n{dump_yaml(file_document(answers))}Run a script with it: impel launch script.py")
    return 0


def write_default(ns: argparse.Namespace) -> int:
    path = _path(ns)
    if os.path.exists(path) and not ns.overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it, --config_file to write "
                          "elsewhere, or edit it with `impel config`")
    gpus = _gpu_count()
    answers: dict[str, object] = {"compute_environment": "LOCAL_MACHINE",
                               "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
                               "num_processes": max(gpus, 1), "num_machines": 1, "machine_rank": 0,
                               "use_cpu": gpus == 0}
    if ns.mixed_precision:
        answers["mixed_precision"] = ns.mixed_precision
    write_config_file(answers, path)
    print(f"Wrote {path} ({gpus} GPU(s) seen):\n{dump_yaml(file_document(answers))}", end="")
    return 0


def show(ns: argparse.Namespace) -> int:
    named = getattr(ns, "config_file", None)
    path, accelerates = env.config_to_read(named)
    if os.path.isfile(path) or named:
        explicit = read_config_file(path)
        origin = " (Accelerate's default config: impel has none of its own, so impel launch reads this one)" \
            if accelerates else ""
        print(f"# {path}{origin}\n{dump_yaml(file_document(explicit)) if explicit else '{}'}")
    else:
        explicit = {}
        print(f"# no config file at {path}; impel launch uses the defaults (write one with `impel config`)\n")
    print("# resolved (defaults filled in; flags to impel launch override these)")
    print(dump_yaml(RunConfig.from_dict(explicit).to_dict()), end="")
    return 0


def convert_file(ns: argparse.Namespace) -> int:
    from impel.config.convert import convert, readable

    explicit = load_config_mapping(ns.file)  # an FSDP1 file (fsdp_version: 1) converts: impel launch refuses it
    # a contradiction in the DeepSpeed JSON is an error, not a value to translate
    _check_deepspeed_json(RunConfig.from_dict(readable(explicit, [])))
    translated, notes = convert(explicit, ns.to)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if ns.output:
        print(f"Wrote {write_config_file(translated, ns.output)}", file=sys.stderr)
    else:
        print(dump_yaml(file_document(translated)), end="")
    return 0


def validate(ns: argparse.Namespace) -> int:
    explicit = read_config_file(ns.file)
    cfg = RunConfig.from_dict(explicit)
    check_elastic_launch(cfg)
    _check_deepspeed_json(cfg)
    summary = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("distributed_type", "num_processes", "num_machines",
                                                           "mixed_precision") if k in explicit)
    if not explicit:
        summary = "empty: every setting takes its default"
    print(f"{ns.file}: valid" + (f" ({summary})" if summary else ""))
    return 0


def _check_deepspeed_json(cfg: RunConfig) -> None:
    """What impel launch checks before any rank starts: the DeepSpeed JSON exists, parses, agrees with itself
    (one of bf16/fp16, the batch sizes) and with the config (stage, precision, accumulation, offload)."""
    if cfg.distributed_type == "DEEPSPEED":
        from impel.config.deepspeed_json import check_before_launch

        check_before_launch(cfg)
