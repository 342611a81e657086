"""``impel.optimizer``: Accelerate's ``accelerate.optimizer`` path (a face over :mod:`impel.runtime.step.optimizer`).
``move_to_device`` is ``send_to_device`` (the same recursive move of an optimizer state); ``patch_optimizer_step``
is an internal step of Accelerate's optimizer and raises ``NotProvidedError`` with the reason on use."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {"AcceleratedOptimizer": "impel.runtime.step.optimizer",
            "move_to_device": "impel.runtime.ranks.collectives:send_to_device",
            "patch_optimizer_step": "impel.config.unsupported"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
