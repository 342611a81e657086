"""``impel.inference``: Accelerate's ``accelerate.inference`` path (pipeline-parallel inference with PiPPy), which is
not in impel's scope: every name imports, and using one raises ``NotProvidedError`` with the reason."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {name: "impel.config.unsupported" for name in (
    "prepare_pippy", "generate_device_map", "find_pippy_batch_size", "build_pipeline", "pippy_forward")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
