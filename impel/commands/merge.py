"""``impel merge-weights CHECKPOINT OUT``: full weights (Hugging Face layout) from any impel checkpoint."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("merge-weights", help="write full weights from a sharded (FSDP) or ZeRO checkpoint",
                              description="Reads a save_state checkpoint on this one process (no GPUs or ranks "
                                          "needed) and writes model.safetensors (or shards + index) into OUT.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory written by save_state")
    p.add_argument("out", metavar="OUT", help="the directory to write the weights into")
    p.add_argument("--model_index", type=int, default=0, help="which prepared model (default: the first)")
    p.add_argument("--max_shard_size", default="10GB", help="split files larger than this (e.g. 5GB)")
    p.add_argument("--unsafe_serialization", action="store_true",
                   help="write pytorch_model.bin (torch.save) instead of safetensors")
    p.set_defaults(handler=main)


def main(ns: argparse.Namespace) -> int:
    import os

    from impel.checkpoint.formats.merge import merge_weights
    from impel.checkpoint.store.layout import CheckpointError
    from impel.config.run_config import ConfigError

    if not os.path.isdir(ns.checkpoint):
        raise ConfigError(f"checkpoint {ns.checkpoint!r} is not a directory; pass a directory written by save_state "
                          "(e.g. project_dir/checkpoints/checkpoint_3)")
    _check_writable(ns.out)
    try:
        files = merge_weights(ns.checkpoint, ns.out, model_index=ns.model_index,
                              safe_serialization=not ns.unsafe_serialization, max_shard_size=ns.max_shard_size)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:  # the output directory: e.g. a parent under /proc, a full disk
        raise ConfigError(f"cannot write the weights into {ns.out!r}: {exc.strerror} ({exc.filename}); pass an OUT "
                          "directory you can write (missing parents are created)") from None
    total = sum(os.path.getsize(f) for f in files)
    print(f"wrote {len(files)} file(s), {total / 1e6:.1f} MB, to {ns.out}:")
    for f in files:
        print(f"  {f}")
    return 0


def _check_writable(out: str) -> None:
    """OUT can be made: its nearest existing ancestor is a directory this user may write (checked before reading
    the checkpoint, instead of a traceback after it)."""
    import os

    from impel.config.run_config import ConfigError

    ancestor = os.path.abspath(out)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if os.path.isdir(out) or (os.path.isdir(ancestor) and os.access(ancestor, os.W_OK | os.X_OK)):
        return
    what = "is not a directory" if not os.path.isdir(ancestor) else "cannot be written by this user"
    raise ConfigError(f"cannot write the weights into {out!r}: {ancestor} {what}; pass an OUT directory under one "
                      "you can write (missing parents are created)")
