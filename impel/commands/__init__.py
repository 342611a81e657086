"""CLI subcommands, one module each; nothing here imports torch at import time."""
