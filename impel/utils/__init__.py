"""``impel.utils``: the names scripts import from ``accelerate.utils``, re-exported from the modules that define
them (a face: nothing is defined here, names are imported on first use).

Accelerate's submodule paths (``impel.utils.dataclasses``, ``.operations``, ``.memory``, ...) are faces too, each
naming its share of :data:`SOURCES`. Names impel deliberately does not provide resolve to placeholders from
:mod:`impel.config.unsupported` that raise ``NotProvidedError`` (a ``NotImplementedError``) with the reason on use.
"""
from __future__ import annotations

from collections.abc import Mapping

from impel.config.unsupported import REASONS, TRACKERS
from impel.exports import lazy_face

_AVAILABILITY = (
    "is_rich_available", "is_tqdm_available", "is_tensorboard_available", "is_wandb_available", "is_mlflow_available",
    "is_comet_ml_available", "is_aim_available", "is_clearml_available", "is_dvclive_available",
    "is_swanlab_available", "is_trackio_available", "is_deepspeed_available", "is_transformers_available",
    "is_datasets_available", "is_peft_available", "is_timm_available", "is_torchvision_available",
    "is_pandas_available", "is_matplotlib_available", "is_bnb_available", "is_schedulefree_available",
    "is_torchdata_stateful_dataloader_available", "is_torch_xla_available", "is_cuda_available",
    "is_mps_available", "is_xpu_available", "is_npu_available", "is_mlu_available", "is_musa_available",
    "is_sdaa_available", "is_hpu_available", "is_neuron_available", "is_bf16_available", "is_fp16_available",
    "is_fp8_available", "is_torch_version", "compare_versions", "is_pytest_available", "is_torchdata_available",
    "is_triton_available", "is_boto3_available", "is_pynvml_available", "is_amdsmi_available", "is_lomo_available",
    "is_import_timer_available", "is_pippy_available", "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available", "is_msamp_available", "is_torchao_available",
    "is_megatron_lm_available", "is_sagemaker_available", "is_4bit_bnb_available", "is_8bit_bnb_available",
    "is_bitsandbytes_multi_backend_available", "is_weights_only_available", "is_rocm_available",
    "is_xccl_available", "is_habana_gaudi1",
)

_CONSTANTS = (
    "MODEL_NAME", "SAFE_MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME",
    "RNG_STATE_NAME", "FSDP_MODEL_NAME", "WEIGHTS_NAME", "WEIGHTS_PATTERN_NAME", "WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "SAFE_WEIGHTS_INDEX_NAME", "PROFILE_PATTERN_NAME",
    "FSDP_SHARDING_STRATEGY", "FSDP_AUTO_WRAP_POLICY", "FSDP_BACKWARD_PREFETCH", "FSDP_STATE_DICT_TYPE",
    "FSDP2_STATE_DICT_TYPE", "DEEPSPEED_MULTINODE_LAUNCHERS", "TORCH_DYNAMO_MODES", "FSDP_PYTORCH_VERSION",
    "FSDP2_PYTORCH_VERSION", "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION", "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION", "STR_OPERATION_TO_FUNC", "CUDA_DISTRIBUTED_TYPES",
    "TORCH_DISTRIBUTED_OPERATION_TYPES", "ComputeEnvironment",
)

# every name below impel.utils (and its submodules) -> the module that defines it
SOURCES: dict[str, str] = {
    **{name: "impel.config.plugins" for name in (
        "AutocastKwargs", "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
        "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs",
        "KwargsHandler", "ProjectConfiguration")},
    "ProfileKwargs": "impel.config.profiling",
    **{name: "impel.config.parallelism" for name in (
        "ParallelismConfig", "TorchTensorParallelConfig", "TorchContextParallelConfig", "TorchTensorParallelPlugin")},
    **{name: "impel.runtime.step.compile" for name in (
        "TorchDynamoPlugin", "DynamoBackend", "is_compiled_module", "has_compiled_regions",
        "extract_model_from_parallel")},
    "DDPCommunicationHookType": "impel.config.ddp_hooks",
    "DistributedType": "impel.config.run_config",
    "PrecisionType": "impel.config.run_config",
    "LoggerType": "impel.trackers.registry",
    **{name: "impel.runtime.loaders.seeding" for name in (
        "RNGType", "set_seed", "synchronize_rng_state", "synchronize_rng_states")},
    "DummyOptim": "impel.config.deepspeed_json",
    "DummyScheduler": "impel.config.deepspeed_json",
    **{name: "impel.runtime.ranks.collectives" for name in (
        "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
        "recursively_apply", "wait_for_everyone", "send_to_device", "is_torch_tensor", "DistributedOperationException",
        "CannotPadNestedTensorWarning")},
    **{name: "impel.runtime.compat.operations" for name in (
        "TensorInformation", "is_tensor_information", "is_namedtuple", "honor_type", "listify", "concatenate",
        "find_batch_size", "ignorant_find_batch_size", "find_device", "get_data_structure", "initialize_tensors",
        "slice_tensors", "convert_to_fp32", "ConvertOutputsToFp32", "convert_outputs_to_fp32", "pad_input_tensors",
        "copy_tensor_to_devices")},
    "tqdm": "impel.runtime.compat.progress_bar",
    **{name: "impel.runtime.step.memory" for name in (
        "find_executable_batch_size", "release_memory", "should_reduce_batch_size", "clear_device_cache")},
    "merge_fsdp_weights": "impel.checkpoint.formats.merge",
    "save": "impel.checkpoint.saving.save_object",
    "load_checkpoint_in_model": "impel.runtime.compat.model_loading",
    **{name: "impel.runtime.compat.availability" for name in _AVAILABILITY},
    **{name: "impel.config.constants" for name in _CONSTANTS},
    **{name: "impel.config.environment" for name in (
        "str_to_bool", "parse_flag_from_env", "parse_choice_from_env", "get_int_from_env", "patch_environment",
        "clear_environment")},
    **{name: "impel.runtime.compat.pyutils" for name in (
        "convert_bytes", "merge_dicts", "get_pretty_name", "recursive_getattr", "is_port_in_use",
        "are_libraries_initialized", "convert_dict_to_env_variables", "check_os_kernel",
        "purge_accelerate_environment")},
    **{name: "impel.runtime.compat.module_tools" for name in (
        "id_tensor_storage", "find_tied_parameters", "dtype_byte_size", "convert_file_size_to_int",
        "compute_module_sizes", "is_peft_model", "get_module_children_bottom_up", "model_has_dtensor")},
    **{name: "impel.config.unsupported" for name in REASONS if name not in TRACKERS},
}


def face_table(*names: str) -> Mapping[str, str]:
    """The share of :data:`SOURCES` an Accelerate submodule path re-exports (a KeyError names a missing one)."""
    return {name: SOURCES[name] for name in names}


_EXPORTS = SOURCES
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
