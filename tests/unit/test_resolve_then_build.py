"""Resolve, then build: every value is settled in one read-only record before any object exists, and the prepared
objects live in one record that the checkpointer and the resilience logic share."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import make_mlp, make_regression
from impel import Accelerator, ConfigError, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from impel.accelerator.resolve import RunArguments, resolve
from impel.config.environment import read_topology


def test_the_resolved_config_is_read_only_with_the_fix_named():
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP"))
    with pytest.raises(AttributeError, match=r"RunConfig.mixed_precision is read-only.*Accelerator\(\.\.\.\)"):
        acc.config.mixed_precision = "bf16"
    with pytest.raises(AttributeError, match="FSDPConfig.sharding_strategy is read-only"):
        acc.config.fsdp_config.sharding_strategy = "FULL_SHARD"
    assert acc.config.fsdp.sharding_strategy == "SHARD_GRAD_OP"


def test_what_the_deepspeed_json_decides_is_in_the_record_before_any_strategy_exists():
    ds = {"gradient_accumulation_steps": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
          "train_micro_batch_size_per_gpu": "auto"}
    record = resolve(None, RunArguments(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds)), read_topology())
    assert record.distributed_type == "DEEPSPEED"
    assert (record.config.gradient_accumulation_steps, record.config.mixed_precision) == (4, "bf16")
    assert (record.deepspeed.stage, record.deepspeed.dtype) == (3, torch.bfloat16)
    assert record.accumulation.num_steps == 4
    with pytest.raises(AttributeError, match="read-only"):
        record.config.gradient_accumulation_steps = 1


def test_a_deepspeed_json_contradicting_the_code_raises_at_resolution():
    ds = {"gradient_accumulation_steps": 4}
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        resolve(None, RunArguments(cpu=True, gradient_accumulation_steps=2,
                                   deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds)), read_topology())


def test_setting_accumulation_steps_later_changes_the_live_state_not_the_record():
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    acc.gradient_accumulation_steps = 3
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_state.num_steps == 3
    assert acc.config.gradient_accumulation_steps == 2  # what was resolved at construction


def test_prepared_objects_live_in_one_record_that_accelerate_s_private_names_view():
    acc = Accelerator(cpu=True)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_regression(16), batch_size=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    record = acc.prepared
    assert record.models == [model] and record.optimizers == [opt] and record.dataloaders == [loader]
    assert record.schedulers == [sched]
    assert acc._models is record.models and acc._optimizers is record.optimizers  # libraries read these names
    assert acc._dataloaders is record.dataloaders and acc._schedulers is record.schedulers
    acc.register_for_checkpointing(sched.scheduler)
    assert record.counts() == {"models": 1, "optimizers": 1, "schedulers": 1, "dataloaders": 1,
                               "registered objects": 1}
    record.forget(loader)
    assert record.dataloaders == []
    with pytest.raises(ValueError, match="was not prepared by this Accelerator"):
        record.forget(loader)
    acc.free_memory()
    assert record.counts()["models"] == 0 and record.counts()["registered objects"] == 1  # as Accelerate's
