"""``impel.data_loader``: Accelerate's ``accelerate.data_loader`` path (a face; sharding lives in
:mod:`impel.runtime.loaders.data`, :mod:`impel.runtime.loaders.shard_layout` and
:mod:`impel.runtime.loaders.prepared_loader`, the standalone
wrappers in :mod:`impel.runtime.loaders.loader_wrappers`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {
    "skip_first_batches": "impel.runtime.loaders.data", "DataLoaderDispatcher": "impel.runtime.loaders.data",
    "DataLoaderShard": "impel.runtime.loaders.data",
    "SeedableRandomSampler": "impel.runtime.loaders.samplers",
    "DataLoaderStateMixin": "impel.runtime.loaders.loader_state",
    "send_to_device": "impel.runtime.ranks.collectives",
    **{name: "impel.runtime.loaders.loader_wrappers" for name in (
        "prepare_data_loader", "BatchSamplerShard", "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader")},
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
