"""``impel.utils.modeling``: Accelerate's ``accelerate.utils.modeling`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "AutocastKwargs", "CustomDtype", "DistributedType", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME",
    "align_module_device", "calculate_maximum_sizes", "check_device_map", "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device", "clean_device_map", "clear_device_cache", "compute_module_sizes",
    "convert_file_size_to_int", "dtype_byte_size", "find_tied_parameters", "get_balanced_memory", "get_grad_scaler",
    "get_max_layer_size", "get_max_memory", "get_mixed_precision_context_manager", "has_offloaded_params",
    "get_state_dict_from_offload", "id_tensor_storage", "infer_auto_device_map", "is_hpu_available",
    "is_mlu_available", "is_mps_available",
    "is_musa_available", "is_npu_available", "is_peft_available", "is_peft_model", "is_sdaa_available",
    "is_torch_version", "is_torch_xla_available", "is_tqdm_available", "is_xpu_available",
    "load_checkpoint_in_model", "load_offloaded_weight", "load_offloaded_weights", "load_state_dict",
    "named_module_tensors", "offload_weight", "retie_parameters", "save_offload_index",
    "set_module_tensor_to_device", "tqdm"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
