"""``impel.utils.random``: Accelerate's ``accelerate.utils.random`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "CUDA_DISTRIBUTED_TYPES", "DistributedType", "RNGType", "is_hpu_available", "is_mlu_available",
    "is_musa_available", "is_neuron_available", "is_npu_available", "is_sdaa_available", "is_torch_xla_available",
    "is_xpu_available", "set_seed", "synchronize_rng_state", "synchronize_rng_states"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
