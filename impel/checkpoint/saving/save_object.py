"""Accelerate's ``save``: write an object once per job (or once per machine), with torch.save or safetensors.

Example::

    save(model.state_dict(), "weights.safetensors", safe_serialization=True)   # main process only
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import IO

logger = logging.getLogger("impel")


def save(obj: object, f: str | os.PathLike[str] | IO[bytes], save_on_each_node: bool = False,
         safe_serialization: bool = False) -> None:
    """Write ``obj`` to ``f`` on the main process (each machine's local main with ``save_on_each_node``); other
    processes do nothing and nobody waits. ``safe_serialization=True`` writes safetensors: ``obj`` must be a
    mapping of names to tensors and ``f`` a path; tensors sharing memory (tied weights) are kept once."""
    from impel.runtime.ranks.process import current_topology

    topo = current_topology()
    writer = topo.local_rank == 0 if save_on_each_node else topo.rank == 0
    if not writer:
        return
    if safe_serialization:
        _save_safetensors(obj, f)
        return
    import torch

    torch.save(obj, f)


def _save_safetensors(obj: object, f: str | os.PathLike[str] | IO[bytes]) -> None:
    import torch

    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise TypeError(f"save(..., safe_serialization=True) needs a dict of tensors, got {type(obj).__name__}; "
                        "pass a state_dict() or use safe_serialization=False (torch.save)")
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"save(..., safe_serialization=True) writes to a path, got {type(f).__name__}; pass a file "
                        "name")
    from safetensors.torch import save_file

    from impel.checkpoint.io.files import dedupe_aliases

    kept, aliases = dedupe_aliases(obj)
    if aliases:
        logger.warning("save(safe_serialization=True): Removed shared tensor %s while saving: they share memory with "
                       "other tensors and are stored once under the first name (safetensors keeps no aliases)",
                       sorted(aliases))
    save_file(kept, os.fspath(f), metadata={"format": "pt"})
