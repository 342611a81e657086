"""``impel.utils.memory``: Accelerate's ``accelerate.utils.memory`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "clear_device_cache", "find_executable_batch_size", "is_cuda_available", "is_hpu_available", "is_mlu_available",
    "is_mps_available", "is_musa_available", "is_neuron_available", "is_npu_available", "is_sdaa_available",
    "is_xpu_available", "release_memory", "should_reduce_batch_size"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
