"""impel: one PyTorch training loop on a CPU, one GPU, many GPUs or many machines.

Names are resolved lazily so that ``import impel`` (and the ``impel`` CLI's help) stay fast and never import
deepspeed or transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "impel.accelerator",
    "ProcessState": "impel.state",
    "PartialState": "impel.state",
    "DataLoaderConfiguration": "impel.plugins",
    "GradientAccumulationPlugin": "impel.plugins",
    "DistributedDataParallelKwargs": "impel.plugins",
    "GradScalerKwargs": "impel.plugins",
    "InitProcessGroupKwargs": "impel.plugins",
    "AutocastKwargs": "impel.plugins",
    "FullyShardedDataParallelPlugin": "impel.plugins",
    "DeepSpeedPlugin": "impel.plugins",
    "ParallelismConfig": "impel.parallelism_config",
    "DummyOptim": "impel.strategies.deepspeed_config",
    "DummyScheduler": "impel.strategies.deepspeed_config",
    "ProjectConfiguration": "impel.plugins",
    "CheckpointError": "impel.checkpoint",
    "merge_weights": "impel.checkpoint",
    "RunConfig": "impel.config",
    "DistributedType": "impel.config",
    "ConfigError": "impel.config",
    "set_seed": "impel.seeding",
    "skip_first_batches": "impel.data",
    "send_to_device": "impel.collectives",
    "gather": "impel.collectives",
    "gather_object": "impel.collectives",
    "reduce": "impel.collectives",
    "broadcast": "impel.collectives",
    "broadcast_object_list": "impel.collectives",
    "pad_across_processes": "impel.collectives",
    "Trainer": "impel.trainer.trainer",
    "TrainingArguments": "impel.trainer.arguments",
    "TrainerCallback": "impel.trainer.callbacks",
    "EarlyStoppingCallback": "impel.trainer.callbacks",
    "TrainerControl": "impel.trainer.state",
    "TrainerState": "impel.trainer.state",
    "EvalPrediction": "impel.trainer.state",
    "PredictionOutput": "impel.trainer.state",
    # Accelerate's other top-level names
    "find_executable_batch_size": "impel.memory",
    "notebook_launcher": "impel.launchers",
    "debug_launcher": "impel.launchers",
    "init_empty_weights": "impel.model_loading",
    "init_on_device": "impel.model_loading",
    "load_checkpoint_in_model": "impel.model_loading",
    "synchronize_rng_states": "impel.seeding",
    "DDPCommunicationHookType": "impel.ddp_hooks",
    "ProfileKwargs": "impel.profiling",
    "is_rich_available": "impel.availability",
    # Accelerate's big-model inference and PiPPy names: importable, raising NotProvidedError (with the reason) on use
    "cpu_offload": "impel.unsupported", "cpu_offload_with_hook": "impel.unsupported",
    "disk_offload": "impel.unsupported", "dispatch_model": "impel.unsupported",
    "infer_auto_device_map": "impel.unsupported", "load_checkpoint_and_dispatch": "impel.unsupported",
    "prepare_pippy": "impel.unsupported",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'impel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
