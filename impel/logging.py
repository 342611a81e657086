"""``impel.logging``: Accelerate's ``accelerate.logging`` path (a face; the logger lives in
:mod:`impel.runtime.compat.logger`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"get_logger": "impel.runtime.compat.logger", "MultiProcessAdapter": "impel.runtime.compat.logger"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
