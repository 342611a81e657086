"""``impel.parallelism_config``: Accelerate's ``accelerate.parallelism_config`` path (a face over
:mod:`impel.config.parallelism`)."""
from __future__ import annotations

from impel.exports import lazy_face

_EXPORTS = {name: "impel.config.parallelism" for name in (
    "ParallelismConfig", "TorchTensorParallelConfig", "TorchContextParallelConfig")}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
