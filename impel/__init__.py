"""impel: one PyTorch training loop on a CPU, one GPU, many GPUs or many machines.

Names are resolved lazily so that ``import impel`` (and the ``impel`` CLI's help) stay fast and never import
deepspeed or transformers.
"""
from __future__ import annotations

from impel.exports import lazy_face

__version__ = "0.1.0"
# the Accelerate release whose behaviour impel provides (and its tests compare with): renamed code that gates
# features on ``accelerate.__version__`` reads this one, not impel's own version
__accelerate_version__ = "1.15.0"

_EXPORTS = {
    "Accelerator": "impel.accelerator.facade",
    "ProcessState": "impel.runtime.ranks.process",
    "PartialState": "impel.runtime.ranks.process",
    "DataLoaderConfiguration": "impel.config.plugins",
    "GradientAccumulationPlugin": "impel.config.plugins",
    "DistributedDataParallelKwargs": "impel.config.plugins",
    "GradScalerKwargs": "impel.config.plugins",
    "InitProcessGroupKwargs": "impel.config.plugins",
    "AutocastKwargs": "impel.config.plugins",
    "FullyShardedDataParallelPlugin": "impel.config.plugins",
    "DeepSpeedPlugin": "impel.config.plugins",
    "ParallelismConfig": "impel.config.parallelism",
    "DummyOptim": "impel.config.deepspeed_json",
    "DummyScheduler": "impel.config.deepspeed_json",
    "ProjectConfiguration": "impel.config.plugins",
    "CheckpointError": "impel.checkpoint",
    "merge_weights": "impel.checkpoint",
    "RunConfig": "impel.config.run_config",
    "DistributedType": "impel.config.run_config",
    "ConfigError": "impel.config.run_config",
    "set_seed": "impel.runtime.loaders.seeding",
    "skip_first_batches": "impel.runtime.loaders.data",
    "send_to_device": "impel.runtime.ranks.collectives",
    "gather": "impel.runtime.ranks.collectives",
    "gather_object": "impel.runtime.ranks.collectives",
    "reduce": "impel.runtime.ranks.collectives",
    "broadcast": "impel.runtime.ranks.collectives",
    "broadcast_object_list": "impel.runtime.ranks.collectives",
    "pad_across_processes": "impel.runtime.ranks.collectives",
    # the Trainer family: transformers' own classes, the Trainer running on impel's Accelerator (impel.trainer.hf;
    # needs the `transformers` extra, imported on first use only)
    "Trainer": "impel.trainer.hf",
    "TrainingArguments": "impel.trainer.hf",
    "TrainerCallback": "impel.trainer.hf",
    "EarlyStoppingCallback": "impel.trainer.hf",
    "TrainerControl": "impel.trainer.hf",
    "TrainerState": "impel.trainer.hf",
    "EvalPrediction": "impel.trainer.hf",
    "PredictionOutput": "impel.trainer.hf",
    # Accelerate's other top-level names
    "find_executable_batch_size": "impel.runtime.step.memory",
    "notebook_launcher": "impel.runtime.compat.launchers",
    "debug_launcher": "impel.runtime.compat.launchers",
    "init_empty_weights": "impel.runtime.compat.model_loading",
    "init_on_device": "impel.runtime.compat.model_loading",
    "load_checkpoint_in_model": "impel.runtime.compat.model_loading",
    "synchronize_rng_states": "impel.runtime.loaders.seeding",
    "DDPCommunicationHookType": "impel.config.ddp_hooks",
    "ProfileKwargs": "impel.config.profiling",
    "is_rich_available": "impel.runtime.compat.availability",
    # Accelerate's big-model inference and PiPPy names: importable, raising NotProvidedError (with the reason) on use
    "cpu_offload": "impel.config.unsupported", "cpu_offload_with_hook": "impel.config.unsupported",
    "disk_offload": "impel.config.unsupported", "dispatch_model": "impel.config.unsupported",
    "infer_auto_device_map": "impel.config.unsupported", "load_checkpoint_and_dispatch": "impel.config.unsupported",
    "prepare_pippy": "impel.config.unsupported",
}

__all__ = sorted(_EXPORTS) + ["__accelerate_version__", "__version__"]
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS, ("__accelerate_version__", "__version__"))
