"""``impel.utils.operations``: Accelerate's ``accelerate.utils.operations`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "CannotPadNestedTensorWarning", "ConvertOutputsToFp32", "DistributedOperationException", "DistributedType",
    "GatheredParameters", "TORCH_DISTRIBUTED_OPERATION_TYPES", "TensorInformation", "broadcast",
    "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32", "copy_tensor_to_devices",
    "find_batch_size", "find_device", "gather", "gather_object", "get_data_structure", "honor_type",
    "ignorant_find_batch_size", "initialize_tensors", "is_namedtuple", "is_npu_available", "is_tensor_information",
    "is_torch_tensor", "is_torch_version", "is_torch_xla_available", "listify", "pad_across_processes",
    "pad_input_tensors", "recursively_apply", "reduce", "send_to_device", "slice_tensors"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
