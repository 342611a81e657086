"""TrainingArguments: validation messages, and the mapping of precision, fsdp / fsdp_config and deepspeed knobs."""
from __future__ import annotations

import json

import pytest

from impel.config.run_config import ConfigError
from impel.trainer.arguments import TrainingArguments
from impel.trainer.distributed import (
    accelerator_kwargs,
    deepspeed_config,
    deepspeed_plugin,
    fsdp_plugin,
)


def test_defaults_leave_launch_knobs_unset(tmp_path):
    args = TrainingArguments(output_dir=tmp_path)
    kwargs = accelerator_kwargs(args)
    assert (kwargs["mixed_precision"], kwargs["gradient_accumulation_steps"], kwargs["cpu"]) == (None, None, None)
    assert "fsdp_plugin" not in kwargs and "deepspeed_plugin" not in kwargs
    project = kwargs["project_config"]
    assert project.project_dir == str(tmp_path) and project.automatic_checkpoint_naming
    assert TrainingArguments().output_dir == "trainer_output"


def test_set_knobs_are_passed_through():
    kwargs = accelerator_kwargs(TrainingArguments(bf16=True, gradient_accumulation_steps=4, use_cpu=True,
                                                  save_total_limit=2))
    assert (kwargs["mixed_precision"], kwargs["gradient_accumulation_steps"], kwargs["cpu"]) == ("bf16", 4, True)
    assert kwargs["project_config"].total_limit is None  # the Trainer rotates, keeping the best (test_trainer_best)


@pytest.mark.parametrize("kwargs, message", [
    ({"bf16": True, "fp16": True}, "choose one mixed-precision mode"),
    ({"lr_scheduler_type": "cosin"}, "did you mean 'cosine'"),
    ({"warmup_steps": 10, "warmup_ratio": 0.1}, "set only one of them"),
    ({"warmup_steps": 2.5}, "whole number of steps"),
    ({"eval_strategy": "step"}, "did you mean 'steps'"),
    ({"save_strategy": "best"}, "save_strategy='best' needs metric_for_best_model"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0 must be an integer >= 1"),
    ({"gradient_accumulation_steps": 0}, "or None"),
    ({"learning_rate": -1.0}, "learning_rate=-1.0 must be a number >= 0"),
    ({"adam_beta2": 1.0}, "must be below 1"),
    ({"max_steps": 0}, "max_steps=0 trains nothing"),
    ({"logging_steps": 0}, "logging_steps=0"),
    ({"save_total_limit": 0}, "keep every checkpoint"),
    ({"report_to": "tensorbord"}, "did you mean 'tensorboard'"),
    ({"resume_from_checkpoint": 3}, "must be a checkpoint directory, True"),
    ({"fsdp": "full_shard auto_warp"}, "did you mean 'auto_wrap'"),
    ({"fsdp": "full_shard shard_grad_op"}, "keep one"),
    ({"fsdp_config": {"min_num_params": 10}}, "fsdp_config is set but fsdp is not"),
    ({"fsdp": True, "deepspeed": {"zero_optimization": {"stage": 2}}}, "choose one strategy"),
])
def test_bad_values_raise_naming_value_and_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainingArguments(**kwargs)


def test_ratios_become_steps():
    args = TrainingArguments(warmup_steps=0.1, logging_steps=0.25, eval_steps=None, save_steps=40)
    assert args.warmup_for(95) == 10  # rounded up, as in transformers
    assert (args.interval("logging_steps", 100), args.interval("eval_steps", 100)) == (25, 25)
    assert args.interval("save_steps", 100) == 40
    assert TrainingArguments(warmup_ratio=0.05).warmup_for(100) == 5


# --- fsdp -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fsdp, strategy, offload", [
    ("full_shard auto_wrap offload", "FULL_SHARD", True),
    (["shard_grad_op", "auto_wrap"], "SHARD_GRAD_OP", None),
    (True, None, None),  # on; the strategy is the launch config's or the default (FULL_SHARD)
    ("hybrid_shard", "HYBRID_SHARD", None),
])
def test_fsdp_option_strings_map_to_the_plugin(fsdp, strategy, offload):
    plugin = fsdp_plugin(TrainingArguments(fsdp=fsdp))
    assert plugin.sharding_strategy == strategy
    assert plugin.cpu_offload == offload
    section = plugin.to_config_section()
    assert section.get("fsdp_sharding_strategy") == strategy


def test_fsdp_config_takes_transformers_keys_with_or_without_prefix(tmp_path):
    config = {"fsdp_transformer_layer_cls_to_wrap": ["BertLayer"], "state_dict_type": "FULL_STATE_DICT",
              "min_num_params": 0, "backward_prefetch": "backward_pre", "fsdp_activation_checkpointing": "true",
              "version": 2, "xla": False, "limit_all_gathers": True, "cpu_ram_efficient_loading": False}
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(config))
    for given in (config, str(path)):
        section = fsdp_plugin(TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config=given)).to_config_section()
        assert section == {"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD",
                           "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
                           "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_state_dict_type": "FULL_STATE_DICT",
                           "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": True}


def test_fsdp1_style_reshard_value_and_offload_params():
    plugin = fsdp_plugin(TrainingArguments(fsdp=True, fsdp_config={"reshard_after_forward": "shard_grad_op",
                                                                   "offload_params": True}))
    section = plugin.to_config_section()
    assert section["fsdp_sharding_strategy"] == "SHARD_GRAD_OP" and section["fsdp_offload_params"] is True


@pytest.mark.parametrize("fsdp, config, message", [
    ("full_shard", {"fsdp_sharding_strategy_x": 1}, "unknown fsdp_config key"),
    ("full_shard", {"reshard_after_forward": False}, "contradicts the sharding strategy FULL_SHARD"),
    ("full_shard offload", {"cpu_offload": False}, "set it once"),
    ("full_shard", {"xla": True}, "impel does not drive XLA"),
    ("full_shard", {"limit_all_gathers": "false"}, "no FSDP2 equivalent"),
    ("full_shard", {"use_orig_params": False}, "fsdp_use_orig_params=false"),
    ("full_shard", {"min_num_params": "many"}, "must be an integer"),
    ("full_shard", "/no/such/fsdp.json", "is not a file"),
])
def test_bad_fsdp_config_raises(fsdp, config, message):
    with pytest.raises(ConfigError, match=message):
        TrainingArguments(fsdp=fsdp, fsdp_config=config)


def test_fsdp_knob_contradicting_the_launched_strategy_raises_naming_both(monkeypatch):
    from impel import Accelerator

    monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"distributed_type": "MULTI_CPU", "use_cpu": True}))
    with pytest.raises(ConfigError, match="distributed_type='FSDP'.*launched as distributed_type='MULTI_CPU'"):
        Accelerator(**accelerator_kwargs(TrainingArguments(fsdp="full_shard")))


# --- precision against the launch config ------------------------------------------------------------------------
def test_precision_knob_at_default_follows_the_launch_config(monkeypatch, tmp_path):
    from impel import Accelerator

    monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"mixed_precision": "bf16", "gradient_accumulation_steps": 2}))
    acc = Accelerator(**accelerator_kwargs(TrainingArguments(output_dir=tmp_path)))
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("bf16", 2)


def test_precision_knob_differing_from_the_launch_config_wins_naming_both(monkeypatch, tmp_path, caplog):
    import logging

    from impel import Accelerator

    monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"mixed_precision": "bf16"}))
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(**accelerator_kwargs(TrainingArguments(output_dir=tmp_path, fp16=True)))
    assert acc.mixed_precision == "fp16"
    assert "mixed_precision='fp16', which overrides the launched config's mixed_precision='bf16'" in caplog.text


# --- deepspeed --------------------------------------------------------------------------------------------------
def test_deepspeed_auto_values_are_filled_from_the_arguments(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = TrainingArguments(deepspeed=str(path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_grad_norm=0.5, bf16=True)
    config = deepspeed_config(args)
    assert config == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                      "gradient_clipping": 0.5, "train_batch_size": "auto", "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 3}}
    assert ds["bf16"] == {"enabled": "auto"}  # the caller's dict is not modified


@pytest.mark.parametrize("ds, kwargs, message", [
    ({"train_micro_batch_size_per_gpu": 8}, {"per_device_train_batch_size": 4}, "make them equal"),
    ({"fp16": {"enabled": True}}, {"bf16": True}, "enables fp16 but TrainingArguments sets bf16=True"),
    ({"bf16": {"enabled": False}}, {"bf16": True}, "bf16.enabled=false"),
])
def test_deepspeed_contradictions_raise(ds, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        deepspeed_config(TrainingArguments(deepspeed=ds, **kwargs))


def test_deepspeed_knob_becomes_the_plugin():
    import impel.config.plugins

    args = TrainingArguments(deepspeed={"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
    plugin = deepspeed_plugin(args)
    assert isinstance(plugin, impel.config.plugins.DeepSpeedPlugin)
    assert "deepspeed_plugin" in accelerator_kwargs(args)


def test_a_deepspeed_json_optimizer_and_scheduler_get_filled_placeholders():
    from impel import DummyOptim, DummyScheduler, Trainer
    from trainer_helpers import tiny_bert

    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    trainer = object.__new__(Trainer)  # only the two factory methods, no Accelerator
    trainer.args = TrainingArguments(deepspeed=ds, learning_rate=1e-3, adam_beta2=0.95, warmup_ratio=0.1)
    trainer.model = tiny_bert()
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, DummyOptim)
    assert (optimizer.lr, optimizer.kwargs["betas"], optimizer.kwargs["eps"]) == (1e-3, (0.9, 0.95), 1e-8)
    scheduler = trainer.create_scheduler(50, optimizer)
    assert isinstance(scheduler, DummyScheduler)
    assert (scheduler.total_num_steps, scheduler.warmup_num_steps) == (50, 5)
