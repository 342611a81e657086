"""``impel.state``: Accelerate's ``accelerate.state`` path (a face; the process state lives in
:mod:`impel.runtime.ranks.process`, the gradient state in :mod:`impel.runtime.step.accumulation`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"PartialState": "impel.runtime.ranks.process", "AcceleratorState": "impel.runtime.ranks.process",
            "ProcessState": "impel.runtime.ranks.process", "GradientState": "impel.runtime.step.accumulation",
            "is_initialized": "impel.runtime.ranks.process"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
