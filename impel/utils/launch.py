"""``impel.utils.launch``: Accelerate's ``accelerate.utils.launch`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "DEEPSPEED_MULTINODE_LAUNCHERS", "DistributedType", "DynamoBackend", "PrecisionType", "PrepareForLaunch",
    "SageMakerDistributedType", "compare_versions", "is_fp8_available", "is_hpu_available", "is_mlu_available",
    "is_musa_available", "is_neuron_available", "is_npu_available", "is_port_in_use", "is_sdaa_available",
    "is_torch_xla_available", "is_xpu_available", "merge_dicts", "prepare_deepspeed_cmd_env",
    "prepare_multi_gpu_env", "prepare_sagemager_args_inputs", "prepare_simple_launcher_cmd_env", "prepare_tpu",
    "str_to_bool"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
