"""DistributedDataParallelKwargs' comm hook fields: what is accepted, and the clear refusals of settings that could
not take effect. The hooks' numbers are compared with Accelerate in
tests/multiprocess/test_ddp_comm_hooks_match_accelerate.py."""
from __future__ import annotations

import logging

import pytest
import torch

from impel import Accelerator, ConfigError, DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from impel.config import ddp_hooks
from impel.config.ddp_hooks import DDPCommunicationHookType, reduction_dtype, refuse_hook_without_ddp


@pytest.mark.parametrize("kwargs", [
    {"comm_hook": "fp16"}, {"comm_hook": DDPCommunicationHookType.BF16},
    {"comm_hook": "power_sgd", "comm_wrapper": "fp16", "comm_state_option": {"matrix_approximation_rank": 2}},
    {"comm_hook": DDPCommunicationHookType.POWER_SGD, "comm_wrapper": DDPCommunicationHookType.BF16},
    {"comm_hook": "power_sgd", "comm_state_option": None}])
def test_hooks_are_accepted_and_are_not_ddp_arguments(kwargs):
    handler = DistributedDataParallelKwargs(find_unused_parameters=True, **kwargs)
    assert handler.to_kwargs() == {"find_unused_parameters": True}  # as Accelerate's to_kwargs


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"comm_hook": "zip"}, "comm_hook='zip'.*not a DDP communication hook; use one of 'no', 'fp16'"),
    ({"comm_wrapper": "power_sgd", "comm_hook": "power_sgd"}, "comm_wrapper='power_sgd'.*use 'no', 'fp16' or 'bf16'"),
    ({"comm_wrapper": "bf16"}, "comm_wrapper='bf16'.*comm_hook='no'.*set comm_hook='power_sgd'"),
    ({"comm_wrapper": "fp16", "comm_hook": "fp16"}, "comm_wrapper='fp16'.*comm_hook='fp16'.*drop comm_wrapper"),
    ({"comm_state_option": {"matrix_approximation_rank": 2}}, "comm_state_option=.*comm_hook='no'.*drop"),
    ({"comm_hook": "fp16", "comm_state_option": {"start_powerSGD_iter": 4}}, "configures PowerSGD.*'fp16'"),
    ({"comm_hook": "power_sgd", "comm_state_option": {"matrix_aproximation_rank": 2}},
     "'matrix_aproximation_rank'.*did you mean 'matrix_approximation_rank'"),
    ({"comm_hook": "power_sgd", "comm_state_option": {"start_powerSGD_iter": 1}},
     "start_powerSGD_iter': 1.*refused by torch's PowerSGDState.*start_powerSGD_iter` > 1"),
    ({"comm_hook": "power_sgd", "comm_state_option": {"process_group": None}}, "'process_group'.*drop the key"),
    ({"comm_hook": "power_sgd", "comm_state_option": [("matrix_approximation_rank", 2)]}, "must be a dict"),
])
def test_settings_that_cannot_take_effect_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DistributedDataParallelKwargs(**kwargs)


def test_batched_power_sgd_is_refused_where_torch_cannot_run_it(monkeypatch):
    monkeypatch.setattr(ddp_hooks, "batched_power_sgd_works", lambda: False)
    with pytest.raises(ConfigError, match=r"'batched_power_sgd'\) cannot compress.*use comm_hook='power_sgd'"):
        DistributedDataParallelKwargs(comm_hook="batched_power_sgd")
    monkeypatch.setattr(ddp_hooks, "batched_power_sgd_works", lambda: True)
    DistributedDataParallelKwargs(comm_hook="batched_power_sgd", comm_wrapper="fp16")


def test_the_probe_sees_torchs_batched_orthogonalize():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    two_d_refused = True
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
        two_d_refused = False
    except (AssertionError, IndexError, RuntimeError):
        pass
    assert ddp_hooks.batched_power_sgd_works() is (not two_d_refused)


def test_a_hook_under_fsdp_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="comm_hook='fp16'.*distributed_type='FSDP'.*drop comm_hook"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(),
                    kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="fp16")])
    with pytest.raises(ConfigError, match="comm_hook='power_sgd'.*distributed_type='DEEPSPEED'"):
        refuse_hook_without_ddp(DistributedDataParallelKwargs(comm_hook="power_sgd"), "DEEPSPEED")
    refuse_hook_without_ddp(DistributedDataParallelKwargs(), "FSDP")  # plain DDP arguments: only unused


def test_a_hook_on_one_process_is_only_unused(caplog):
    handler = DistributedDataParallelKwargs(comm_hook="fp16")
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(cpu=True, kwargs_handlers=[handler])
    assert "DistributedDataParallelKwargs has no effect with distributed_type=" in caplog.text
    model = acc.prepare(torch.nn.Linear(2, 1))
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)


def test_reduction_dtype_follows_the_hook_or_the_power_sgd_wrapper():
    assert reduction_dtype(None) is None
    assert reduction_dtype(DistributedDataParallelKwargs()) is None
    assert reduction_dtype(DistributedDataParallelKwargs(comm_hook="fp16")) == torch.float16
    assert reduction_dtype(DistributedDataParallelKwargs(comm_hook="bf16")) == torch.bfloat16
    assert reduction_dtype(DistributedDataParallelKwargs(comm_hook="power_sgd")) is None
    assert reduction_dtype(DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="bf16")) == torch.bfloat16
