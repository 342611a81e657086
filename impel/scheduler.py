"""``impel.scheduler``: Accelerate's ``accelerate.scheduler`` path (a face over :mod:`impel.runtime.step.optimizer`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"AcceleratedScheduler": "impel.runtime.step.optimizer"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
