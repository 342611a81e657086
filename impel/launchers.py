"""``impel.launchers``: Accelerate's ``accelerate.launchers`` path (a face over
:mod:`impel.runtime.compat.launchers`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"notebook_launcher": "impel.runtime.compat.launchers", "debug_launcher": "impel.runtime.compat.launchers"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
