"""``impel.utils.other``: Accelerate's ``accelerate.utils.other`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "DistributedType", "FSDP_PYTORCH_VERSION", "check_os_kernel", "clean_state_dict_for_safetensors",
    "compile_regions", "compile_regions_deepspeed", "compile_regions_fsdp2", "convert_bytes", "convert_model",
    "extract_model_from_parallel", "get_model_tp_size", "get_module_children_bottom_up", "get_pretty_name",
    "has_compiled_regions", "id_tensor_storage", "is_compiled_module", "is_deepspeed_available", "is_port_in_use",
    "is_torch_version", "is_torch_xla_available", "is_weights_only_available", "load", "merge_dicts",
    "model_has_dtensor", "recursive_getattr", "reduce", "save", "wait_for_everyone", "write_basic_config"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
