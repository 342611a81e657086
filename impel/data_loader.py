"""``impel.data_loader``: Accelerate's ``accelerate.data_loader`` path (a face; sharding lives in
:mod:`impel.runtime.data`, :mod:`impel.runtime.shard_layout` and :mod:`impel.runtime.prepared_loader`, the standalone
wrappers in :mod:`impel.runtime.loader_wrappers`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {
    "skip_first_batches": "impel.runtime.data", "DataLoaderDispatcher": "impel.runtime.data",
    "DataLoaderShard": "impel.runtime.data",
    "SeedableRandomSampler": "impel.runtime.samplers", "DataLoaderStateMixin": "impel.runtime.loader_state",
    "send_to_device": "impel.runtime.collectives",
    **{name: "impel.runtime.loader_wrappers" for name in (
        "prepare_data_loader", "BatchSamplerShard", "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader")},
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
