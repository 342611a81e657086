"""The Trainer entry: ``TrainingArguments`` knobs (``fsdp``, ``deepspeed``, ...) plumbed into one Accelerator.

Modules by job: ``arguments`` (TrainingArguments and its checks), ``distributed`` (arguments -> Accelerator
arguments and plugins), ``trainer`` (the loop), ``callbacks`` (hooks, early stopping), ``progress`` (progress bar,
summary), ``best_model`` (best checkpoint, rotation), ``optimization`` (weight-decay groups), ``collate`` (default
collator, column pruning), ``schedules`` (learning-rate schedules, step planning), ``evaluation`` (gathering
predictions), ``state`` (TrainerState, TrainerControl, EvalPrediction, PredictionOutput), ``plot`` (loss PNGs);
``hf`` is transformers' own Trainer on impel's Accelerator (``hf_fields``: what impel does with its fields;
``hf_fsdp`` / ``hf_deepspeed``: its FSDP and DeepSpeed knobs; ``hf_callbacks``: impel's additions, auto-resume).
Names resolve lazily, so building ``TrainingArguments`` does not import torch.

Example::

    from impel import Trainer, TrainingArguments

    trainer = Trainer(model, TrainingArguments(output_dir="out", max_steps=100), train_dataset=train)
    trainer.train()
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainingArguments": "arguments", "Trainer": "trainer", "TrainerCallback": "callbacks",
    "EarlyStoppingCallback": "callbacks", "ProgressCallback": "progress", "default_data_collator": "collate",
    "get_scheduler": "schedules", "EvalPrediction": "state", "PredictionOutput": "state", "TrainerControl": "state",
    "TrainerState": "state", "TrainOutput": "state",
}

__all__ = ["EarlyStoppingCallback", "EvalPrediction", "PredictionOutput", "ProgressCallback", "TrainOutput", "Trainer",
           "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments", "default_data_collator",
           "get_scheduler"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'impel.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
