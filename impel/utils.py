"""``impel.utils``: the names scripts import from ``accelerate.utils``, re-exported from the modules that define
them (a face: nothing is defined here, names are imported on first use)."""
from __future__ import annotations

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
    "is_fp8_available", "is_torch_version", "compare_versions",
)

_EXPORTS = {
    **{name: "impel.config.plugins" for name in (
        "AutocastKwargs", "DataLoaderConfiguration", "DeepSpeedPlugin", "DistributedDataParallelKwargs",
        "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs",
        "KwargsHandler", "ProjectConfiguration")},
    "ProfileKwargs": "impel.config.profiling",
    **{name: "impel.config.parallelism" for name in (
        "ParallelismConfig", "TorchTensorParallelConfig", "TorchContextParallelConfig")},
    **{name: "impel.runtime.compile" for name in (
        "TorchDynamoPlugin", "DynamoBackend", "is_compiled_module", "has_compiled_regions")},
    "DDPCommunicationHookType": "impel.config.ddp_hooks",
    "DistributedType": "impel.config.run_config",
    "PrecisionType": "impel.config.run_config",
    "LoggerType": "impel.trackers.registry",
    **{name: "impel.runtime.seeding"
       for name in ("RNGType", "set_seed", "synchronize_rng_state", "synchronize_rng_states")},
    "DummyOptim": "impel.config.deepspeed_json",
    "DummyScheduler": "impel.config.deepspeed_json",
    **{name: "impel.runtime.collectives" for name in (
        "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
        "recursively_apply", "wait_for_everyone")},
    "send_to_device": "impel.runtime.collectives",
    "tqdm": "impel.runtime.progress_bar",
    **{name: "impel.runtime.memory" for name in (
        "find_executable_batch_size", "release_memory", "should_reduce_batch_size", "clear_device_cache")},
    "merge_fsdp_weights": "impel.checkpoint.merge",
    "save": "impel.checkpoint.save_object",
    "load_checkpoint_in_model": "impel.runtime.model_loading",
    **{name: "impel.runtime.availability" for name in _AVAILABILITY},
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
