"""``impel test``: run impel's built-in check (:mod:`impel.selftest`) on every rank of the configured job."""
from __future__ import annotations

import argparse
from typing import Any

from .flags import add_config_flags
from .launch import main as launch_main


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("test", allow_abbrev=False,
                              help="check collectives, data sharding and training on the configured ranks",
                              description="Runs impel.selftest under the same config and flags as impel launch; "
                                          "exits 0 when every check passes on every rank.")
    add_config_flags(p)
    p.set_defaults(handler=main)


def main(ns: argparse.Namespace) -> int:
    ns.module, ns.script, ns.script_args = True, "impel.selftest", []
    return launch_main(ns)
