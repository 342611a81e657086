"""``impel.checkpointing``: Accelerate's ``accelerate.checkpointing`` path. Its functions are the internal steps of
Accelerate's ``save_state`` / ``load_state`` (file names and layout of Accelerate's checkpoints); impel's
checkpoints are written and read by ``accelerator.save_state`` / ``load_state`` (which also read Accelerate's
folders). Every name imports; using one raises ``NotProvidedError`` with the reason and what to use."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {name: "impel.config.unsupported" for name in (
    "save_accelerator_state", "load_accelerator_state", "save_custom_state", "load_custom_state")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
