"""Accelerate's DeepSpeedPlugin members on impel's plugin (``deepspeed_config``, ``get_value``, ``is_auto``,
``selected``, ``select``, ``fill_match``, ``deepspeed_config_process``, ...), compared with Accelerate 1.15's plugin
built from the same JSON, and several named plugins settled at ``Accelerator(...)``: the first active, each with its
own settled JSON, ``select_deepspeed_plugin`` switching. Training with several plugins runs on 2 ranks in
tests/multiprocess/test_deepspeed_several_plugins.py."""
from __future__ import annotations

import accelerate.utils
import pytest

from impel import Accelerator, DeepSpeedPlugin
from impel.config.run_config import ConfigError
from impel.config.unsupported import NotProvidedError
from impel.state import AcceleratorState

JSON = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                              "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}


def test_the_json_reads_as_accelerates_plugin_built_from_the_same_json():
    mine, theirs = DeepSpeedPlugin(hf_ds_config=dict(JSON)), accelerate.utils.DeepSpeedPlugin(hf_ds_config=dict(JSON))
    for key in ("zero_optimization.stage", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                "zero_optimization.offload_optimizer.device", "gradient_clipping", "gradient_accumulation_steps",
                "train_micro_batch_size_per_gpu", "no.such.key"):
        assert mine.get_value(key) == theirs.get_value(key), key
        assert mine.is_auto(key) == theirs.is_auto(key), key
    assert mine.get_value("no.such.key", 7) == theirs.get_value("no.such.key", 7) == 7
    assert mine.deepspeed_config["zero_optimization"]["stage"] == theirs.deepspeed_config["zero_optimization"]["stage"]
    assert mine.selected is theirs.selected is False
    for plugin in (mine, theirs):
        with pytest.raises(ValueError, match="select_deepspeed_plugin|enable_deepspeed_plugin"):
            plugin.select()
        with pytest.raises(NotImplementedError, match="select_deepspeed_plugin|enable_deepspeed_plugin"):
            plugin.selected = True
    with pytest.raises(TypeError):  # before an Accelerator settles it, the JSON is read-only
        mine.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    with pytest.raises(ConfigError, match="settled when the Accelerator is built"):
        mine.fill_match("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu=4)
    with pytest.raises(NotProvidedError, match="zero3_init_context_manager"):
        mine.zero3_init_context_manager()


def test_an_accelerator_settles_the_plugin_and_fills_its_unset_fields():
    plugin = DeepSpeedPlugin(hf_ds_config=dict(JSON))
    acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
    config = plugin.deepspeed_config
    assert isinstance(config, dict) and config is acc.deepspeed_plugin.deepspeed_config
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.zero3_save_16bit_model) == (3, "cpu", True)
    assert plugin.selected and config["gradient_accumulation_steps"] == 2 and config["bf16"] == {"enabled": False}
    assert plugin.is_zero3_init_enabled() is False  # impel's default zero3_init_flag (Accelerate's follows stage 3)
    plugin.set_mixed_precision("no")
    with pytest.raises(ConfigError, match="settled to 'no'"):
        plugin.set_mixed_precision("bf16")
    # Accelerate's fill_match / deepspeed_config_process: "auto" values take the kwargs, mismatches raise
    plugin.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=4, gradient_clipping=9.0)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_clipping"] == 1.0
    with pytest.raises(ValueError, match="gradient_clipping=1.0 vs arg gradient_clipping=9.0"):
        plugin.deepspeed_config_process(gradient_clipping=9.0)
    # what was written into the open values reaches the next engine; a settled value changed raises
    assert acc.strategy.configs.base_for().ds["train_micro_batch_size_per_gpu"] == 4
    config["zero_optimization"]["stage"] = 2
    with pytest.raises(ConfigError, match="'zero_optimization.stage'.*settled it to 3"):
        acc.strategy.configs.base_for()
    # replaced whole, as transformers' propagate_args_to_deepspeed does: read back the same way
    plugin.deepspeed_config = {**config, "zero_optimization": {**config["zero_optimization"], "stage": 3},
                               "train_micro_batch_size_per_gpu": 2}
    assert acc.strategy.configs.base_for().ds["train_micro_batch_size_per_gpu"] == 2
    before = DeepSpeedPlugin()
    before.deepspeed_config = {"zero_optimization": {"stage": 1}}  # before an Accelerator: the plugin's JSON
    assert before.hf_ds_config == {"zero_optimization": {"stage": 1}}
    assert before.get_value("zero_optimization.stage") == 1


def test_several_named_plugins_each_settled_the_first_active_select_switches():
    student, ref = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0), DeepSpeedPlugin(hf_ds_config=dict(JSON))
    acc = Accelerator(cpu=True, deepspeed_plugins={"student": student, "ref": ref})
    state = AcceleratorState()
    assert state.deepspeed_plugins == {"student": student, "ref": ref} and state.get_deepspeed_plugin("ref") is ref
    assert acc.deepspeed_plugin is student and student.selected and not ref.selected
    assert (student.deepspeed_config["zero_optimization"]["stage"], ref.deepspeed_config["zero_optimization"]["stage"],
            acc.strategy.resolved.stage) == (2, 3, 2)
    state.select_deepspeed_plugin("ref")
    assert acc.deepspeed_plugin is ref and state.deepspeed_plugin is ref and ref.selected and not student.selected
    assert acc.strategy.resolved.stage == 3 and acc.strategy.resolved.clipping == 1.0
    with pytest.raises(KeyError, match="'teacher'.*'student', 'ref'"):
        state.select_deepspeed_plugin("teacher")
    state.select_deepspeed_plugin("student")
    assert acc.deepspeed_plugin is student and acc.strategy.resolved.stage == 2


def test_several_plugins_at_different_precisions_raise_not_provided():
    with pytest.raises(NotProvidedError, match="deepspeed_plugins\\['ref'\\]: bf16.enabled=true.*'no'.*one precision"):
        Accelerator(cpu=True, deepspeed_plugins={"student": DeepSpeedPlugin(zero_stage=2), "ref": DeepSpeedPlugin(
            hf_ds_config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})})
    same = DeepSpeedPlugin()
    with pytest.raises(ValueError, match="same DeepSpeedPlugin object under two names"):
        Accelerator(cpu=True, deepspeed_plugins={"a": same, "b": same})
