"""``impel.logging``: Accelerate's ``accelerate.logging`` path (a face; the logger lives in
:mod:`impel.process_logging`)."""
from __future__ import annotations

from .exports import lazy_face

_EXPORTS = {"get_logger": "impel.process_logging", "MultiProcessAdapter": "impel.process_logging"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
