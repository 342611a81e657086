"""Layer 3 (below the strategies), checkpoint storage. Checkpoints: the whole training state saved atomically, loaded
safely, exported as full weights.

Four rooms, each with a map in its ``__init__``: ``io`` (bytes: files written, hashed and read back safely),
``store`` (directories: layout, the atomic commit, targets, temporary directories, ownership, object storage),
``formats`` (what a strategy writes: the formats' table, full files, DCP shards, DeepSpeed's engines, Hugging Face's
weight layout, the merge) and ``saving`` (one save as it runs: the session every writer takes, asynchronous staging,
the collective steps, the training state around the model). ``errors`` (``CheckpointError``) is shared by all.
The sequence that runs them for ``save_state`` / ``load_state`` is the Accelerator's (``impel.accelerator.save_load``).
"""
from __future__ import annotations

from impel.checkpoint.errors import CheckpointError
from impel.exports import lazy_face

__all__ = ["CheckpointError", "merge_weights"]
_EXPORTS = {"merge_weights": "impel.checkpoint.formats.merge"}  # lazily: it imports torch.distributed.checkpoint
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS, ("CheckpointError",))
