"""impel: one PyTorch training loop on a CPU, one GPU, many GPUs or many machines.

Names are resolved lazily so that ``import impel`` (and the ``impel`` CLI's help) stay fast and never import
deepspeed or transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Accelerator": "impel.accelerator.facade",
    "ProcessState": "impel.runtime.process",
    "PartialState": "impel.runtime.process",
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
    "set_seed": "impel.runtime.seeding",
    "skip_first_batches": "impel.runtime.data",
    "send_to_device": "impel.runtime.collectives",
    "gather": "impel.runtime.collectives",
    "gather_object": "impel.runtime.collectives",
    "reduce": "impel.runtime.collectives",
    "broadcast": "impel.runtime.collectives",
    "broadcast_object_list": "impel.runtime.collectives",
    "pad_across_processes": "impel.runtime.collectives",
    "Trainer": "impel.trainer.trainer",
    "TrainingArguments": "impel.trainer.arguments",
    "TrainerCallback": "impel.trainer.callbacks",
    "EarlyStoppingCallback": "impel.trainer.callbacks",
    "TrainerControl": "impel.trainer.state",
    "TrainerState": "impel.trainer.state",
    "EvalPrediction": "impel.trainer.state",
    "PredictionOutput": "impel.trainer.state",
    # Accelerate's other top-level names
    "find_executable_batch_size": "impel.runtime.memory",
    "notebook_launcher": "impel.runtime.launchers",
    "debug_launcher": "impel.runtime.launchers",
    "init_empty_weights": "impel.runtime.model_loading",
    "init_on_device": "impel.runtime.model_loading",
    "load_checkpoint_in_model": "impel.runtime.model_loading",
    "synchronize_rng_states": "impel.runtime.seeding",
    "DDPCommunicationHookType": "impel.config.ddp_hooks",
    "ProfileKwargs": "impel.config.profiling",
    "is_rich_available": "impel.runtime.availability",
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
