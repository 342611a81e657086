"""``impel to-fsdp2 --config_file X --output_file Y``: Accelerate's ``accelerate to-fsdp2``, the one command between
an FSDP1 config file (which ``impel launch`` refuses) and one impel runs."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from impel.config.run_config import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("to-fsdp2", help="rewrite an FSDP1 config file (fsdp_version: 1) for FSDP2, as "
                              "accelerate to-fsdp2", description="Rewrite an Accelerate FSDP1 config file for FSDP2, "
                              "key for key as accelerate to-fsdp2 does, with a note per change.")
    p.add_argument("--config_file", required=True, metavar="FILE", help="the config file to convert")
    p.add_argument("--overwrite", action="store_true", help="replace the output file (without --output_file: "
                   "the config file itself)")
    p.add_argument("--output_file", default=None, metavar="OUT", help="where to write the FSDP2 config")
    p.set_defaults(handler=main)


def main(ns: argparse.Namespace) -> int:
    import yaml

    from impel.config.to_fsdp2 import to_fsdp2

    output = _output_path(ns)
    with open(ns.config_file, encoding="utf-8") as fh:
        try:
            config = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {ns.config_file!r} is not valid YAML ({exc}); fix its syntax") from None
    if not isinstance(config, dict) or not config:
        raise ConfigError(f"config file {ns.config_file!r} holds no config (empty or not a mapping of keys); pass "
                          "the Accelerate config file to convert")
    converted, notes = to_fsdp2(config)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    folder = os.path.dirname(os.path.abspath(output))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".impel-to-fsdp2-", suffix=".yaml", delete=False,
                                     encoding="utf-8") as out:
        yaml.safe_dump(converted, out)  # sorted keys, as accelerate to-fsdp2 writes them
    os.replace(out.name, output)
    print(f"Wrote {output}", file=sys.stderr)
    return 0


def _output_path(ns: argparse.Namespace) -> str:
    if not os.path.isfile(ns.config_file):
        raise ConfigError(f"--config_file {ns.config_file!r} does not exist; pass the FSDP1 config file to convert")
    if ns.output_file is None:
        if not ns.overwrite:
            raise ConfigError("impel to-fsdp2 needs --output_file OUT (or --overwrite to rewrite "
                              f"{ns.config_file} in place)")
        return str(ns.config_file)
    if os.path.exists(ns.output_file) and not ns.overwrite:
        raise ConfigError(f"--output_file {ns.output_file!r} already exists; pass --overwrite to replace it or "
                          "choose another path")
    return str(ns.output_file)
