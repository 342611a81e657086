"""``impel.memory_utils``: Accelerate's ``accelerate.memory_utils`` path, which Accelerate keeps only to warn that
it moved to ``utils.memory``: importing it gives the same ``FutureWarning``, naming impel's paths, and the names
that moved resolve here as well."""
from __future__ import annotations

import warnings

from impel.exports import lazy_face

warnings.warn("memory_utils has been reorganized to utils.memory. Import `find_executable_batch_size` from the main "
              "`__init__`: `from impel import find_executable_batch_size` to avoid this warning.", FutureWarning,
              stacklevel=2)

_EXPORTS = {name: "impel.runtime.step.memory" for name in ("find_executable_batch_size", "release_memory")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
