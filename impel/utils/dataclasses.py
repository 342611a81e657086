"""``impel.utils.dataclasses``: Accelerate's ``accelerate.utils.dataclasses`` path (a face over impel's modules; see
:mod:`impel.utils`)."""
from __future__ import annotations

from ..exports import lazy_face
from . import face_table

_EXPORTS = face_table(
    "AORecipeKwargs", "AutocastKwargs", "BnbQuantizationConfig", "ComputeEnvironment", "CustomDtype",
    "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedPlugin", "DeepSpeedSequenceParallelConfig",
    "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend", "FP8RecipeKwargs", "FSDP2_PYTORCH_VERSION",
    "FSDP_AUTO_WRAP_POLICY", "FSDP_BACKWARD_PREFETCH", "FSDP_SHARDING_STRATEGY", "FullyShardedDataParallelPlugin",
    "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs", "KwargsHandler", "LoggerType",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "MSAMPRecipeKwargs", "MegatronLMPlugin", "PrecisionType",
    "ProfileKwargs", "ProjectConfiguration", "RNGType", "SageMakerDistributedType", "TERecipeKwargs",
    "TensorInformation", "TorchContextParallelConfig", "TorchDynamoPlugin", "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION", "add_model_config_to_megatron_parser",
    "compare_versions", "get_module_class_from_name",
    "is_cuda_available", "is_hpu_available", "is_mlu_available", "is_msamp_available",
    "is_musa_available", "is_neuron_available", "is_npu_available", "is_rocm_available", "is_torch_version",
    "is_torchao_available", "is_transformer_engine_available", "is_xpu_available", "parse_flag_from_env",
    "str_to_bool"
)
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
