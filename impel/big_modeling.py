"""``impel.big_modeling``: Accelerate's ``accelerate.big_modeling`` path for building models without weights and
loading weights into them (a face; they live in :mod:`impel.runtime.model_loading`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {name: "impel.runtime.model_loading" for name in ("init_empty_weights", "init_on_device",
                                                      "load_checkpoint_in_model")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
