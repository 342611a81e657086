"""Layer 3 (below the strategies), checkpoint storage. Checkpoints: the whole training state saved atomically, loaded
safely, exported as full weights.

Modules, by job: ``layout`` (names, atomic commit, manifest, verification, rotation), ``files`` (safe readers and
writers: safetensors, ``torch.load(weights_only=True)``), ``state`` (RNG, counters, dataloaders, registered
objects), ``collective`` (every rank must call; errors shared), ``full`` (model/optimizer as full files: single
device, DDP, FSDP FULL_STATE_DICT), ``sharded`` (DCP: FSDP SHARDED_STATE_DICT, resharding), ``hf`` (Hugging Face
weight layout), ``merge`` (any checkpoint to full weights), ``deepspeed_engines`` (DeepSpeed engines' own
checkpoints, loaded safely, and their merge), ``tempdirs`` (a save's temporary directory, its lock and the cleaning
of dead ones), ``errors`` (``CheckpointError``), ``staging`` (asynchronous saves: the state staged at
the call, written and committed on a background thread), ``restricted`` (Accelerate's pickles, unpickled through
an allowlist), ``options`` (save_state / load_state keyword arguments), ``digests`` / ``hashing`` (the manifest's
checksums), ``cooperative`` (FULL_STATE_DICT written by every rank), ``full_slices`` (FULL_STATE_DICT read back
by every rank, its own shards only), ``dcp_raw`` (DCP shard files of raw bytes, planned per rank), ``save_object``
(Accelerate's ``save``), ``ownership`` (which files are the checkpoint's and which the user's), ``direct_io`` (files
written around the page cache on I/O threads), ``named_state`` (state dicts by name, names recorded at the first
save) and ``storage`` (a full disk or read-only target as one line).
The sequence that runs them for ``save_state`` / ``load_state`` is the Accelerator's (``impel.accelerator.save_load``).
"""
from __future__ import annotations

from impel.checkpoint.errors import CheckpointError
from impel.exports import lazy_face

__all__ = ["CheckpointError", "merge_weights"]
_EXPORTS = {"merge_weights": "impel.checkpoint.merge"}  # lazily: it imports torch.distributed.checkpoint
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS, ("CheckpointError",))
