"""``impel.local_sgd``: Accelerate's ``accelerate.local_sgd`` path (a face over :mod:`impel.accelerator.local_sgd`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"LocalSGD": "impel.accelerator.local_sgd"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
