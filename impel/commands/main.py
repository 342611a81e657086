"""The ``impel`` command. Subcommands arrive with the launcher issue; ``--version`` works now."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="impel", description="Run one PyTorch training loop anywhere.")
    parser.add_argument("--version", action="version", version=f"impel {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
