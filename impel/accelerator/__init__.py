"""Layer 6, the Accelerator (``impel.accelerator`` is also Accelerate's ``accelerate.accelerator`` path).

- ``facade``: ``Accelerator``, the one object a training loop talks to; it forwards to the modules below.
- ``resolve``: every value of a run settled before anything is built (the ``RunRecord``).
- ``prepared``: the record of what was prepared and registered.
- ``settings``, ``process_methods``: the run's settings and the collectives / process-control methods.
- ``save_load``: the ``save_state`` / ``load_state`` sequence; ``load_accelerate`` and
  ``load_accelerate_weights``: checkpoints written by Accelerate.
- ``resilience``: automatic resume, preemption, non-finite losses; ``local_sgd``: Local SGD.
- ``not_provided``: Accelerate's fp8, LOMO and DeepSpeed-internal members, raising ``NotProvidedError`` on use.
"""
from __future__ import annotations

from impel.exports import lazy_face

# lazily: the facade imports torch, and the command line imports ``resilience`` from here without it
_EXPORTS = {
    "Accelerator": "impel.accelerator.facade",
    # what scripts import from Accelerate's ``accelerate.accelerator`` module besides the Accelerator
    "AutocastKwargs": "impel.config.plugins", "DataLoaderConfiguration": "impel.config.plugins",
    "DeepSpeedPlugin": "impel.config.plugins", "DistributedDataParallelKwargs": "impel.config.plugins",
    "FullyShardedDataParallelPlugin": "impel.config.plugins", "GradScalerKwargs": "impel.config.plugins",
    "GradientAccumulationPlugin": "impel.config.plugins", "InitProcessGroupKwargs": "impel.config.plugins",
    "KwargsHandler": "impel.config.plugins", "ProjectConfiguration": "impel.config.plugins",
    "ProfileKwargs": "impel.config.profiling", "DistributedType": "impel.config.run_config",
    "PrecisionType": "impel.config.run_config", "ParallelismConfig": "impel.config.parallelism",
    "DummyOptim": "impel.config.deepspeed_json", "DummyScheduler": "impel.config.deepspeed_json",
    "PartialState": "impel.runtime.ranks.process", "AcceleratorState": "impel.runtime.ranks.process",
    "GradientState": "impel.runtime.step.accumulation", "RNGType": "impel.runtime.loaders.seeding",
    "AcceleratedOptimizer": "impel.runtime.step.optimizer", "AcceleratedScheduler": "impel.runtime.step.optimizer",
    "TorchDynamoPlugin": "impel.runtime.step.compile", "DynamoBackend": "impel.runtime.step.compile",
    "LoggerType": "impel.trackers.registry",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
