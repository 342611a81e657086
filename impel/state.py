"""``impel.state``: Accelerate's ``accelerate.state`` path (a face; the process state lives in
:mod:`impel.runtime.process`, the gradient state in :mod:`impel.runtime.accumulation`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"PartialState": "impel.runtime.process", "AcceleratorState": "impel.runtime.process",
            "ProcessState": "impel.runtime.process", "GradientState": "impel.runtime.accumulation"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
