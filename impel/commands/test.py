"""``impel test``: run impel's built-in check (:mod:`impel.commands.selftest`) on every rank of the configured job."""
from __future__ import annotations

import argparse

from impel.commands.flags import add_config_flags
from impel.commands.launch import main as launch_main


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("test", allow_abbrev=False,
                              help="check collectives, data sharding and training on the configured ranks",
                              description="Runs impel's self-test under the same config and flags as impel launch; "
                                          "exits 0 when every check passes on every rank.")
    add_config_flags(p)
    p.set_defaults(handler=main)


def main(ns: argparse.Namespace) -> int:
    ns.module, ns.script, ns.script_args = True, "impel.commands.selftest", []
    return launch_main(ns)
