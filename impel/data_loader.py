"""``impel.data_loader``: Accelerate's ``accelerate.data_loader`` path (a face; sharding lives in
:mod:`impel.runtime.data`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"skip_first_batches": "impel.runtime.data", "DataLoaderShard": "impel.runtime.data",
            "send_to_device": "impel.runtime.collectives"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
