"""The ``impel`` command: config, launch, env, test, estimate-memory, merge-weights, compare, to-fsdp2.

Bad input (a ConfigError) prints one paragraph naming the problem and the fix and exits with code 2, without a
Python traceback and before any process starts. ``impel --help`` and ``impel config show`` never import torch.
"""
from __future__ import annotations

import argparse
import sys

from impel.commands import compare, config, env, estimate, launch, merge, test, to_fsdp2


def build_parser() -> argparse.ArgumentParser:
    from impel import __version__

    parser = argparse.ArgumentParser(prog="impel", description="Run one PyTorch training loop anywhere: one CPU, "
                                     "one GPU, many GPUs or many machines, with DDP, FSDP2 or DeepSpeed.")
    parser.add_argument("--version", action="version", version=f"impel {__version__}")
    sub = parser.add_subparsers(dest="command",
                                metavar="{config,launch,env,test,estimate-memory,merge-weights,compare,to-fsdp2}")
    for module in (config, launch, env, test, estimate, merge, compare, to_fsdp2):
        module.register(sub)
    return parser


def valued_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The ``--flags`` of every subcommand that take a value: the token after one is its value, not the script."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= valued_flags(sub)
        elif action.option_strings and action.nargs != 0:
            out |= {s for s in action.option_strings if s.startswith("--")}
    return out


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` as the user wrote it: bool flags alone or with a value, the script after the flags."""
    from impel.commands.flags import bool_values_joined

    return parser.parse_args(bool_values_joined(argv, valued_flags(parser)))


def main(argv: list[str] | None = None) -> int:
    from impel.config.run_config import ConfigError

    parser = build_parser()
    ns = parse(parser, sys.argv[1:] if argv is None else list(argv))
    handler = getattr(ns, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(ns)
    except ConfigError as exc:
        print(f"impel {ns.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
