"""transformers' ``deepspeed=`` knob, served by impel's DeepSpeed strategy.

transformers' ``TrainingArguments(deepspeed="ds.json" or a dict)`` fills the JSON's ``"auto"`` values from the
arguments (``HfTrainerDeepSpeedConfig.trainer_config_process``: batch size, accumulation, ``max_grad_norm``,
bf16/fp16, the optimizer's and scheduler's learning rate, betas, eps, weight decay) and wraps it in Accelerate's
``DeepSpeedPlugin``. On impel's Accelerator that JSON becomes impel's :class:`DeepSpeedPlugin` (:func:`plugin_for`),
and the plugin's ``hf_ds_config`` is transformers' config object, as on Accelerate, so transformers' own DeepSpeed
code (``trainer_config_finalize``, the input dtype, ZeRO-3 detection) reads it unchanged. transformers accumulates
itself (the Accelerator gets ``num_steps=1`` and each micro-batch's ``sync_gradients``), so impel's engine is built
with ``gradient_accumulation_steps=1`` and told each accumulation boundary (``set_gradient_accumulation_boundary``):
the JSON's value only sizes ``train_batch_size``, which the engine recomputes.

transformers' ``deepspeed_init`` hands the Accelerator Accelerate's ``DummyOptim`` / ``DummyScheduler`` (the JSON's
optimizer and scheduler); importing :mod:`impel.trainer.hf` re-points ``transformers.trainer.deepspeed_init`` to
:func:`deepspeed_init`, which gives impel's placeholders to impel's Accelerator (carrying the values transformers
filled once it knew the step count) and leaves every other Accelerator to transformers' own.

Example::

    args = TrainingArguments(output_dir="out", use_cpu=True, deepspeed={"zero_optimization": {"stage": 2},
                             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})
    Trainer(model=model, args=args, train_dataset=train).train()   # impel's ZeRO-2 engine, transformers' loop
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import transformers.trainer

from impel.config.deepspeed_json import DummyOptim, DummyScheduler
from impel.config.plugins import DeepSpeedPlugin
from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

_TRANSFORMERS_DEEPSPEED_INIT = transformers.trainer.deepspeed_init


def plugin_for(args: TrainingArguments) -> DeepSpeedPlugin | None:
    """impel's DeepSpeedPlugin for ``TrainingArguments(deepspeed=...)`` (None without it)."""
    if not args.deepspeed:
        if getattr(args, "deepspeed_plugin", None) is not None:
            raise ConfigError("transformers' Trainer on impel was launched with DeepSpeed (ACCELERATE_USE_DEEPSPEED "
                              "or a DeepSpeed launch config) without TrainingArguments(deepspeed=...): pass the "
                              "DeepSpeed JSON as TrainingArguments(deepspeed='ds.json' or a dict) and launch without "
                              "DeepSpeed")
        return None
    ds = copy.deepcopy(args.hf_deepspeed_config.config)
    ds["gradient_accumulation_steps"] = 1  # transformers accumulates; the engine is told each boundary
    ds.pop("train_batch_size", None)  # = micro batch x 1 x world size, filled by impel at prepare
    return DeepSpeedPlugin(hf_ds_config=ds)


def adopt(args: TrainingArguments, accelerator: Any) -> bool:  # its state's deepspeed_plugin: set at run time
    """After impel's Accelerator is built: expose transformers' config object on the plugin (as Accelerate's
    plugin does) and check what transformers' arguments assumed. Returns whether DeepSpeed is on."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return False
    if not args.deepspeed:
        raise ConfigError("transformers' Trainer on impel was launched with DeepSpeed without TrainingArguments("
                          "deepspeed=...): pass the DeepSpeed JSON as TrainingArguments(deepspeed='ds.json' or a "
                          "dict) and launch without DeepSpeed")
    if args.auto_find_batch_size:
        raise ConfigError("TrainingArguments(auto_find_batch_size=True) with deepspeed=...: impel builds the "
                          "DeepSpeed engine once; set per_device_train_batch_size and auto_find_batch_size=False")
    plugin.hf_ds_config = args.hf_deepspeed_config  # transformers' HfTrainerDeepSpeedConfig
    return True


def _optimizer(theirs: Any) -> torch.optim.Optimizer | None:  # Accelerate's DummyOptim: read by its fields
    if type(theirs).__name__ != "DummyOptim":
        return theirs
    return DummyOptim(theirs.params, lr=theirs.lr, weight_decay=theirs.weight_decay, **theirs.kwargs)


def _scheduler(theirs: Any, optimizer: Any, hf_config: HfTrainerDeepSpeedConfig) -> object:
    if type(theirs).__name__ != "DummyScheduler":
        return theirs
    total = hf_config.get_value("scheduler.params.total_num_steps")
    warmup = hf_config.get_value("scheduler.params.warmup_num_steps")
    return DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=warmup or 0,
                          lr_scheduler_callable=theirs.lr_scheduler_callable, **theirs.kwargs)


def deepspeed_init(trainer: Trainer, num_training_steps: int,
                   inference: bool = False) -> tuple[torch.optim.Optimizer | None, object]:
    """transformers' ``deepspeed_init`` (it finalizes the JSON and picks the JSON's or the Trainer's optimizer and
    scheduler); on impel's Accelerator, Accelerate's placeholders become impel's."""
    optimizer, scheduler = _TRANSFORMERS_DEEPSPEED_INIT(trainer, num_training_steps, inference=inference)
    from impel.accelerator.facade import Accelerator

    if not isinstance(trainer.accelerator, Accelerator):
        return optimizer, scheduler
    ours = _optimizer(optimizer)
    return ours, _scheduler(scheduler, ours, trainer.args.hf_deepspeed_config)


def install() -> None:
    """Point transformers' module-level ``deepspeed_init`` at the dispatcher above (idempotent)."""
    transformers.trainer.deepspeed_init = deepspeed_init
