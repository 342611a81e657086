"""``impel.data_loader``: Accelerate's ``accelerate.data_loader`` path (a face; sharding lives in
:mod:`impel.data`)."""
from __future__ import annotations

from .exports import lazy_face

_EXPORTS = {"skip_first_batches": "impel.data", "DataLoaderShard": "impel.data", "send_to_device": "impel.collectives"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
