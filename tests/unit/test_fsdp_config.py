"""FSDP without ranks: the plugin's conversion to the fsdp_config section, the merge with a launched config,
the mesh layouts and the choice of FSDP units (wrap policies, layer detection on transformers models)."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from impel import FullyShardedDataParallelPlugin
from impel.config.run_config import ConfigError, FSDPConfig, merge_code_arguments
from impel.strategies.fsdp import mesh_layout
from impel.strategies.fsdp_wrap import check_requested, select_units
from tiny_transformers import tiny_bert, tiny_gpt2, tiny_llama


# --- the plugin -------------------------------------------------------------------------------------------------
def test_plugin_gives_only_explicit_fields_as_yaml_keys():
    plugin = FullyShardedDataParallelPlugin(sharding_strategy="shard_grad_op", transformer_cls_names_to_wrap=[
        "GPT2Block", nn.Linear], cpu_offload=True, auto_wrap_policy="transformer_based_wrap")
    assert plugin.to_config_section() == {
        "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "GPT2Block,Linear", "fsdp_offload_params": True}
    assert FullyShardedDataParallelPlugin().to_config_section() == {}


def test_plugin_accepts_torch_fsdp_objects():
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        MixedPrecision,
        MixedPrecisionPolicy,
        ShardingStrategy,
        StateDictType,
    )

    plugin = FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                            backward_prefetch=BackwardPrefetch.BACKWARD_POST,
                                            state_dict_type=StateDictType.FULL_STATE_DICT,
                                            cpu_offload=CPUOffload(offload_params=True), fsdp_version=2)
    assert plugin.to_config_section() == {"fsdp_version": 2, "fsdp_sharding_strategy": "HYBRID_SHARD",
                                          "fsdp_backward_prefetch": "BACKWARD_POST",
                                          "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": True}
    assert FullyShardedDataParallelPlugin(cpu_offload=CPUOffloadPolicy()).to_config_section() == {
        "fsdp_offload_params": True}
    assert FullyShardedDataParallelPlugin(sharding_strategy=2).to_config_section() == {
        "fsdp_sharding_strategy": "SHARD_GRAD_OP"}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=policy)
    assert plugin.code_arguments(None)["mixed_precision"] == "bf16"
    fsdp1 = MixedPrecision(param_dtype=torch.float16)
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=fsdp1).mixed_precision == "fp16"
    as_dict = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert FullyShardedDataParallelPlugin(mixed_precision_policy=as_dict).mixed_precision == "bf16"


@pytest.mark.parametrize("kwargs, message", [
    ({"sharding_strategy": "SHARD_EVERYTHING"}, "fsdp_sharding_strategy='SHARD_EVERYTHING' is not allowed"),
    ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, "contradicts"),
    ({"use_orig_params": False}, "fsdp_use_orig_params=false has no FSDP2 equivalent"),
    ({"cpu_ram_efficient_loading": True, "sync_module_states": False}, "needs fsdp_sync_module_states=true"),
    ({"cpu_offload": True, "offload_params": False}, "same switch"),
    ({"auto_wrap_policy": lambda *a: True}, "impel takes a policy name"),
    ({"mixed_precision_policy": "fp8"}, "mixed_precision_policy='fp8') is unknown"),
    ({"mixed_precision_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}},
     "reduce_dtype=torch.bfloat16 is not supported"),
    ({"backward_prefetch": "BACKWARDS"}, "fsdp_backward_prefetch='BACKWARDS' is not allowed"),
])
def test_plugin_rejects_bad_values_with_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        FullyShardedDataParallelPlugin(**kwargs)


def test_plugin_merges_over_launched_config_key_by_key(caplog):
    launched = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}
    code = FullyShardedDataParallelPlugin(offload_params=True, sharding_strategy="FULL_SHARD").code_arguments(None)
    cfg = merge_code_arguments(launched, code)
    assert cfg.distributed_type == "FSDP"
    assert cfg.fsdp.sharding_strategy == "FULL_SHARD" and cfg.fsdp.offload_params is True
    differs = FullyShardedDataParallelPlugin(sharding_strategy="NO_SHARD").code_arguments(None)
    with caplog.at_level("WARNING", logger="impel"):
        assert merge_code_arguments(launched, differs).fsdp.sharding_strategy == "NO_SHARD"  # the plugin wins
    assert "fsdp_config.fsdp_sharding_strategy='NO_SHARD', which overrides" in caplog.text
    with pytest.raises(ConfigError, match="distributed_type='FSDP'.*'DEEPSPEED'"):
        merge_code_arguments({"distributed_type": "DEEPSPEED"}, code)


def test_plugin_mixed_precision_must_agree_with_the_accelerator_argument():
    plugin = FullyShardedDataParallelPlugin(mixed_precision_policy="bf16")
    assert plugin.code_arguments("bf16")["mixed_precision"] == "bf16"
    with pytest.raises(ConfigError, match="mixed_precision='fp16'.*contradicts"):
        plugin.code_arguments("fp16")


# --- mesh ---------------------------------------------------------------------------------------------------------
def test_mesh_layouts():
    assert mesh_layout("FULL_SHARD", 8, 4) == ((8,), None)  # torch's default mesh (fully_shard without one)
    assert mesh_layout("SHARD_GRAD_OP", 8, 4) == ((8,), None)
    assert mesh_layout("NO_SHARD", 8, 4) == ((8, 1), ("replicate", "shard"))
    assert mesh_layout("HYBRID_SHARD", 8, 4) == ((2, 4), ("replicate", "shard"))
    assert mesh_layout("HYBRID_SHARD_ZERO2", 2, 2) == ((1, 2), ("replicate", "shard"))
    with pytest.raises(ConfigError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"):
        mesh_layout("HYBRID_SHARD", 6, 4)


# --- units (wrap policies) ----------------------------------------------------------------------------------------
def _cfg(**kwargs) -> FSDPConfig:
    return FSDPConfig(**kwargs).validate()


def _names(units):
    return [type(u).__name__ for u in units]


@pytest.mark.parametrize("build, layer", [(tiny_gpt2, "GPT2Block"), (tiny_llama, "LlamaDecoderLayer"),
                                          (tiny_bert, "BertLayer")])
def test_detects_transformer_layers(build, layer):
    model = build()
    for policy in (None, "TRANSFORMER_BASED_WRAP"):
        units, matched = select_units(model, _cfg(auto_wrap_policy=policy))
        assert _names(units).count(layer) == 2 and layer in matched
        # everything transformers lists in _no_split_modules is a unit, as in Accelerate (Bert also names its
        # embeddings)
        assert set(_names(units)) == set(matched) <= set(model._no_split_modules)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 4)  # 36 parameters
        self.fc2 = nn.Linear(4, 8)  # 40 parameters


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)


def test_plain_module_defaults_to_root_only_and_explicit_names_work():
    model = Stack()
    assert select_units(model, _cfg()) == ([], set())
    units, matched = select_units(model, _cfg(transformer_layer_cls_to_wrap="Block"))
    assert _names(units) == ["Block"] * 3 and matched == {"Block"}
    assert select_units(tiny_gpt2(), _cfg(auto_wrap_policy="NO_WRAP")) == ([], set())


def test_detection_failure_lists_candidate_classes():
    with pytest.raises(ConfigError, match=r"TRANSFORMER_BASED_WRAP.*Stack.*candidates: Block \(x3\)"):
        select_units(Stack(), _cfg(auto_wrap_policy="TRANSFORMER_BASED_WRAP"))


def test_a_name_found_in_no_prepared_model_is_an_error():
    models = [Stack(), nn.Linear(2, 2)]
    matched = set().union(*(select_units(m, _cfg(transformer_layer_cls_to_wrap="Block,Blok"))[1] for m in models))
    check_requested("Block", models, matched)
    with pytest.raises(ConfigError, match="Blok is not a module class.*Stack: Block \\(x3\\)"):
        check_requested("Block,Blok", models, matched)


def test_size_based_wrap_bottom_up():
    model = Stack()  # each Block 76 parameters (36 + 40), head 18
    units, _ = select_units(model, _cfg(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=70))
    assert units == list(model.blocks)
    units, _ = select_units(model, _cfg(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=40))
    assert units == [b.fc2 for b in model.blocks]  # a Block keeps 36 < 40 once its fc2 is a unit
    units, _ = select_units(model, _cfg(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100))
    assert units == []  # the ModuleList (228) is a container, never a unit; the rest stays with the root


def test_tied_parameters_stay_in_one_unit():
    model = Stack()
    model.head.weight = model.blocks[0].fc1.weight  # a tie across two candidate units
    units, _ = select_units(model, _cfg(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1))
    assert model.blocks[0] not in units and model.blocks[0].fc1 not in units and model.head not in units
    assert model.blocks[0].fc2 in units and model.blocks[1].fc1 in units
    gpt2 = tiny_gpt2()  # embedding and lm_head are tied: neither may become a unit of its own
    units, _ = select_units(gpt2, _cfg(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1))
    assert gpt2.lm_head not in units and gpt2.transformer.wte not in units


# --- the precision report's default (single device / DDP) -------------------------------------------------------
def test_precision_report_on_one_process(capsys):
    from impel import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    before = acc.precision_report()
    assert before.optimizer_states == torch.float32  # predicted from the parameters before the first step
    acc.backward(model(torch.randn(3, 4)).float().sum())
    opt.step()
    report = acc.precision_report(print_report=True)
    assert (report.stored_params, report.compute, report.gradients, report.reduction, report.optimizer_states) == (
        torch.float32, torch.bfloat16, torch.float32, None, torch.float32)
    assert report.strategy == "NO" and report.mixed_precision == "bf16"
    printed = capsys.readouterr().out
    assert "compute (forward/backward)  bfloat16" in printed and "gradient reduction          -" in printed


def test_fsdp_version_1_raises_naming_the_switch(tmp_path):
    """impel runs FSDP2 only: FSDP1 asked for by the plugin, a config file or the launch flag raises."""
    from impel.config.run_config import RunConfig

    with pytest.raises(ConfigError, match=r"fsdp_version=1 selects FSDP1.*Set fsdp_version to 2"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ConfigError, match="impel runs FSDP2"):
        RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}})
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    (tmp_path / "train.py").write_text("")
    (tmp_path / "c.yaml").write_text("{}\n")
    argv = ["launch", "--config_file", str(tmp_path / "c.yaml"), "--use_fsdp", "--fsdp_version", "1",
            str(tmp_path / "train.py")]
    with pytest.raises(ConfigError, match="fsdp_version=1 selects FSDP1"):
        plan_launch(build_parser().parse_args(bool_values_joined(argv)))


def test_the_fsdp_plugin_in_effect_is_built_when_the_run_is_resolved_not_on_read(monkeypatch):
    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(reshard_after_forward=False))
    built = acc.fsdp_plugin
    monkeypatch.setattr(FullyShardedDataParallelPlugin, "__init__", lambda *a, **k: pytest.fail("built on read"))
    assert acc.fsdp_plugin is built and built.reshard_after_forward is False and acc.deepspeed_plugin is None
