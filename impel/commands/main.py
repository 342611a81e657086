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


def main(argv: list[str] | None = None) -> int:
    from impel.commands.flags import bool_values_joined
    from impel.config.run_config import ConfigError

    parser = build_parser()
    ns = parser.parse_args(bool_values_joined(sys.argv[1:] if argv is None else list(argv)))
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
