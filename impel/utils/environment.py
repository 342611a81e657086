"""``impel.utils.environment``: Accelerate's ``accelerate.utils.environment`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "are_libraries_initialized", "check_cuda_fp8_capability", "check_cuda_p2p_ib_support", "clear_environment",
    "convert_dict_to_env_variables", "get_cpu_distributed_information", "get_current_device_type", "get_gpu_info",
    "get_int_from_env", "parse_choice_from_env", "parse_flag_from_env", "patch_environment",
    "purge_accelerate_environment", "set_numa_affinity", "str_to_bool"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
