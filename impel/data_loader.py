"""``impel.data_loader``: Accelerate's ``accelerate.data_loader`` path (a face; sharding lives in
:mod:`impel.data`, the standalone wrappers in :mod:`impel.loader_wrappers`)."""
from __future__ import annotations

from .exports import lazy_face

_EXPORTS = {
    "skip_first_batches": "impel.data", "DataLoaderShard": "impel.data", "SeedableRandomSampler": "impel.data",
    "send_to_device": "impel.collectives",
    **{name: "impel.loader_wrappers" for name in (
        "prepare_data_loader", "BatchSamplerShard", "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader")},
    "DataLoaderDispatcher": "impel.unsupported",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
