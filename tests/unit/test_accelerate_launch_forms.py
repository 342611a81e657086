"""Config and flag forms Accelerate writes or accepts, read the same way by impel: FSDP1 answers in
``fsdp_reshard_after_forward``, strategy numbers as text, hyphenated flags, and the launcher's own flags."""
from __future__ import annotations

import argparse

import pytest

from impel import ConfigError, RunConfig
from impel.commands import launch
from impel.commands.flags import bool_values_joined, explicit_from_flags_list


@pytest.mark.parametrize("value,strategy", [("FULL_SHARD", "FULL_SHARD"), ("SHARD_GRAD_OP", "SHARD_GRAD_OP"),
                                            ("HYBRID_SHARD", "HYBRID_SHARD"),
                                            ("HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP"), (True, "FULL_SHARD")])
def test_reshard_after_forward_takes_fsdp1_strategy_names(value, strategy):
    cfg = RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": value}})
    assert cfg.fsdp.reshard_after_forward is (value in ("FULL_SHARD", "HYBRID_SHARD", True))
    if value in ("FULL_SHARD", "SHARD_GRAD_OP", True):
        assert cfg.fsdp.resolved_sharding_strategy == strategy


def test_reshard_after_forward_name_contradicting_the_strategy_raises():
    with pytest.raises(ConfigError, match="contradicts fsdp_sharding_strategy='FULL_SHARD'"):
        RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {
            "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}})


@pytest.mark.parametrize("number", [1, "1", "2", 5])
def test_sharding_strategy_numbers_as_int_or_text(number):
    names = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 5: "HYBRID_SHARD_ZERO2"}
    cfg = RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": number}})
    assert cfg.fsdp.sharding_strategy == names[int(number)]
    assert explicit_from_flags_list(["--use_fsdp", "--fsdp_sharding_strategy", str(number)])["fsdp_config"] == {
        "fsdp_sharding_strategy": names[int(number)]}


def test_hyphenated_flags_mean_the_underscored_ones():
    assert explicit_from_flags_list(["--mixed-precision", "bf16", "--num-processes=2", "--use_fsdp",
                                     "--fsdp-reshard-after-forward", "SHARD_GRAD_OP"]) == {
        "mixed_precision": "bf16", "num_processes": 2, "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_reshard_after_forward": False}}


def test_hyphens_after_the_script_are_the_scripts():
    argv = ["launch", "--mixed-precision", "bf16", "train.py", "--learning-rate", "3e-4", "--mixed-precision", "x"]
    assert bool_values_joined(argv) == ["launch", "--mixed_precision", "bf16", "train.py", "--learning-rate", "3e-4",
                                        "--mixed-precision", "x"]


def _ns(**kw):
    base = {"tee": None, "log_dir": None, "no_python": False, "rdzv_conf": None}
    return argparse.Namespace(**{**base, **kw})


def test_launcher_flags_reach_torchrun():
    assert launch._agent_arguments(_ns(tee="3", log_dir="/logs", no_python=True, rdzv_conf="join_timeout=60")) == [
        "--tee", "3", "--log_dir", "/logs", "--no_python", "--rdzv_conf", "join_timeout=60"]


@pytest.mark.parametrize("kw,match", [({"tee": "4"}, "--tee 4 is not one of")])
def test_launcher_flags_impel_cannot_honour_raise(kw, match):
    with pytest.raises(ConfigError, match=match):
        launch._agent_arguments(_ns(**kw))


def test_fsdp_ignored_modules_is_named_as_not_supported_yet():
    with pytest.raises(ConfigError, match="'fsdp_ignored_modules' .* is not supported yet"):
        RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_ignored_modules": "lm_head"}})
