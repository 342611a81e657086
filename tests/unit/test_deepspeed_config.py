"""The DeepSpeed JSON: settling impel's values against it, filling "auto", and the plugin (no deepspeed needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from impel.config.deepspeed_json import (
    DummyOptim,
    DummyScheduler,
    check_before_launch,
    fill_runtime,
    init_config,
    load_json,
    resolve_static,
)
from impel.config.plugins import DeepSpeedPlugin
from impel.config.run_config import ConfigError, merge_code_arguments

ALL_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                          "offload_optimizer": {"device": "auto"}},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def run_config(section=None, **top):
    code = {"distributed_type": "DEEPSPEED", "deepspeed_config": section or {}, **top}
    return merge_code_arguments(None, code)


def resolve(ds, section=None, **top):
    config = run_config(section, **top)
    resolved, decided = resolve_static(json.loads(json.dumps(ds)), "the test JSON", config, json_given=True)
    return resolved, config.with_values(**decided)


def tiny_params():
    return [torch.nn.Parameter(torch.zeros(2))]


def test_a_json_of_auto_values_gets_impel_s_concrete_values():
    section = {"zero_stage": 3, "gradient_clipping": 0.5, "offload_optimizer_device": "cpu",
               "zero3_save_16bit_model": True}
    resolved, config = resolve(ALL_AUTO, section, mixed_precision="bf16", gradient_accumulation_steps=2)
    optim = DummyOptim(tiny_params(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    sched = DummyScheduler(optim, total_num_steps=100, warmup_num_steps=10)
    ds = fill_runtime(resolved, micro_batch=4, world=2, optimizer=optim, scheduler=sched, has_optimizer=True)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["train_batch_size"] == 4 * 2 * 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_optimizer"] == {"device": "cpu"}
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                                         "total_num_steps": 100}
    assert (resolved.stage, resolved.dtype, resolved.clipping, resolved.save_16bit) == (3, torch.bfloat16, 0.5, True)
    assert config.gradient_accumulation_steps == 2


def test_without_json_the_plugin_defaults_apply_and_clipping_is_off():
    config = run_config()
    resolved, _ = resolve_static({}, "the DeepSpeed config impel builds", config, json_given=False)
    ds = fill_runtime(resolved, micro_batch=8, world=2, optimizer=torch.optim.SGD(tiny_params(), lr=0.1),
                      scheduler=None, has_optimizer=True)
    # Accelerate's DeepSpeedPlugin default stage; DeepSpeed's own default clipping (1.0) would clip a loop that
    # never asked for it, so impel writes 0 (off) unless told
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["gradient_clipping"] == 0.0
    sizes = (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_accumulation_steps"])
    assert sizes == (8, 16, 1)
    assert ds["zero_allow_untested_optimizer"] is True  # any torch optimizer runs under ZeRO
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}


def test_a_json_without_a_stage_keeps_deepspeed_s_default():
    resolved, _ = resolve({"train_micro_batch_size_per_gpu": 2})
    assert resolved.stage == 0 and "zero_optimization" not in resolved.ds


@pytest.mark.parametrize("section, top, ds, names", [
    ({"zero_stage": 3}, {}, {"zero_optimization": {"stage": 2}}, ("zero_stage=3", "zero_optimization.stage=2")),
    ({"gradient_clipping": 1.0}, {}, {"gradient_clipping": 0.3}, ("gradient_clipping=1.0", "gradient_clipping=0.3")),
    ({}, {"gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 2},
     ("gradient_accumulation_steps=4", "gradient_accumulation_steps=2")),
    ({}, {"mixed_precision": "no"}, {"bf16": {"enabled": True}}, ("mixed_precision='no'", "bf16.enabled=true")),
    ({}, {"mixed_precision": "bf16"}, {"bf16": {"enabled": False}}, ("mixed_precision='bf16'", "bf16.enabled=false")),
    ({"offload_optimizer_device": "none"}, {},
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     ("offload_optimizer_device='none'", "zero_optimization.offload_optimizer.device='cpu'")),
])
def test_an_explicit_value_contradicting_the_json_raises_naming_both(section, top, ds, names):
    with pytest.raises(ConfigError) as err:
        resolve(ds, section, **top)
    for name in names:
        assert name in str(err.value)
    assert "the test JSON" in str(err.value)


def test_concrete_json_values_are_adopted_when_impel_was_not_told():
    resolved, config = resolve({"gradient_accumulation_steps": 4, "bf16": {"enabled": True}})
    assert config.gradient_accumulation_steps == 4 and config.mixed_precision == "bf16"
    assert resolved.dtype == torch.bfloat16


def test_the_dataloader_batch_size_must_agree_with_a_concrete_micro_batch():
    resolved, _ = resolve({"train_micro_batch_size_per_gpu": 8})
    with pytest.raises(ConfigError, match=r"batch size per rank=4 contradicts train_micro_batch_size_per_gpu=8"):
        fill_runtime(resolved, micro_batch=4, world=2, optimizer=None, scheduler=None, has_optimizer=True)
    resolved, _ = resolve({"train_batch_size": 10})
    with pytest.raises(ConfigError, match=r"\(4 \* 1 \* 2\)=8 contradicts train_batch_size=10"):
        fill_runtime(resolved, micro_batch=4, world=2, optimizer=None, scheduler=None, has_optimizer=True)


def test_an_unknown_batch_size_asks_for_the_dataloader():
    resolved, _ = resolve({})
    with pytest.raises(ConfigError, match="pass the training DataLoader to the same prepare"):
        fill_runtime(resolved, micro_batch=None, world=2, optimizer=None, scheduler=None, has_optimizer=True)
    # an engine without an optimizer (evaluation only) never reads it
    ds = fill_runtime(resolved, micro_batch=None, world=2, optimizer=None, scheduler=None, has_optimizer=False)
    assert ds["train_micro_batch_size_per_gpu"] == 1


def test_auto_values_nothing_can_fill_are_listed():
    resolved, _ = resolve({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
                           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})
    with pytest.raises(ConfigError, match=r"DummyOptim gives no betas"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=DummyOptim(tiny_params(), lr=0.1), scheduler=None,
                     has_optimizer=True)
    with pytest.raises(ConfigError, match=r"sets zero_optimization.reduce_bucket_size to \"auto\", which impel "
                                          r"fills from the model's config.hidden_size, and Linear has none"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=DummyOptim(tiny_params(), lr=0.1, betas=(0.9, 0.9)),
                     scheduler=None, has_optimizer=True, model=torch.nn.Linear(2, 2))
    resolved, _ = resolve({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}})
    with pytest.raises(ConfigError, match=r"cannot fill: zero_optimization.sub_group_size"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=None, scheduler=None, has_optimizer=False)


def tiny_bert(hidden=64):
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                vocab_size=50))


@pytest.mark.parametrize("stage,json_given,model,sized", [
    (3, False, "bert", True),      # ZeRO-3 from flags/plugin: sized from the model, not DeepSpeed's 5e8 buckets
    (3, False, "linear", False),   # no width to size from: DeepSpeed's defaults stay
    (2, False, "bert", False),     # stage 2 keeps DeepSpeed's defaults
    (3, True, "bert", False),      # a user's JSON is taken as written (only its "auto" values are filled)
])
def test_zero3_without_a_json_sizes_its_buckets_from_the_model(stage, json_given, model, sized):
    config = run_config({"zero_stage": stage})
    resolved, _ = resolve_static({"zero_optimization": {"stage": stage}}, "the config", config,
                                 json_given=json_given)
    module = tiny_bert(64) if model == "bert" else torch.nn.Linear(2, 2)
    zero = fill_runtime(resolved, micro_batch=2, world=1, optimizer=None, scheduler=None, has_optimizer=False,
                        model=module)["zero_optimization"]
    expected = {"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
                "stage3_param_persistence_threshold": 640}
    assert {k: zero[k] for k in expected if k in zero} == (expected if sized else {})


def test_bucket_sizes_of_auto_come_from_the_model_width():
    """transformers' example ZeRO-3 JSON writes "auto" for these; they follow config.hidden_size as in
    transformers' and Accelerate's integrations."""
    model = tiny_bert(64)
    resolved, _ = resolve({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                 "stage3_prefetch_bucket_size": "auto",
                                                 "stage3_param_persistence_threshold": "auto"}})
    ds = fill_runtime(resolved, micro_batch=2, world=1, optimizer=None, scheduler=None, has_optimizer=False,
                      model=model)
    zero = ds["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)


def test_optimizer_and_scheduler_come_from_code_or_json_not_both():
    resolved, _ = resolve({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    with pytest.raises(ConfigError, match="also defines an optimizer; pass impel.DummyOptim"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=torch.optim.SGD(tiny_params(), lr=0.1),
                     scheduler=None, has_optimizer=True)
    resolved, _ = resolve({})
    with pytest.raises(ConfigError, match="has no \"optimizer\" section"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=DummyOptim(tiny_params()), scheduler=None,
                     has_optimizer=True)
    opt = torch.optim.SGD(tiny_params(), lr=0.1)
    with pytest.raises(ConfigError, match="has no \"scheduler\" section"):
        fill_runtime(resolved, micro_batch=2, world=1, optimizer=opt, scheduler=DummyScheduler(opt),
                     has_optimizer=True)


@pytest.mark.parametrize("section, ds, match", [
    ({"offload_param_device": "cpu"}, {"zero_optimization": {"stage": 2}}, "needs ZeRO stage 3"),
    ({"zero3_init_flag": True}, {"zero_optimization": {"stage": 1}}, "zero3_init_flag=True needs ZeRO stage 3"),
    ({"zero3_save_16bit_model": True}, {"zero_optimization": {"stage": 2}}, "zero3_save_16bit_model=True needs"),
    ({}, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "needs offload_param_nvme_path"),
    ({"offload_optimizer_device": "cpu"}, {"zero_optimization": {"stage": 0}}, "needs ZeRO stage 1, 2 or 3"),
])
def test_impossible_combinations_raise(section, ds, match):
    with pytest.raises(ConfigError, match=match):
        resolve(ds, section)


def test_init_config_parses_before_batch_sizes_are_known():
    resolved, _ = resolve(ALL_AUTO, {"zero_stage": 3, "zero3_init_flag": True})
    cfg = init_config(resolved)
    assert "optimizer" not in cfg and "train_batch_size" not in cfg
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["zero_optimization"]["stage"] == 3


def test_load_json_names_the_file_in_errors(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"ds.json' is not valid JSON"):
        load_json(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_json(str(tmp_path / "missing.json"))
    good = {"zero_optimization": {"stage": 1}}
    ds, name = load_json(good)
    ds["zero_optimization"]["stage"] = 3
    assert good["zero_optimization"]["stage"] == 1  # a copy: the user's dict is never modified
    assert name == "DeepSpeedPlugin(hf_ds_config=<dict>)"


def test_the_plugin_gives_only_its_explicit_fields(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{}")
    plugin = DeepSpeedPlugin(hf_ds_config=str(path), zero_stage=3, offload_param_device="cpu")
    assert plugin.code_arguments(None) == {
        "distributed_type": "DEEPSPEED", "gradient_accumulation_steps": None,
        "deepspeed_config": {"zero_stage": 3, "offload_param_device": "cpu", "deepspeed_config_file": str(path)}}
    # a dict JSON stays in the process: it is not part of the JSON-serialisable config
    assert "deepspeed_config_file" not in DeepSpeedPlugin(hf_ds_config={"a": 1}).to_config_section()
    assert DeepSpeedPlugin(gradient_accumulation_steps=4).code_arguments(None)["gradient_accumulation_steps"] == 4
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2\) contradicts DeepSpeedPlugin"):
        DeepSpeedPlugin(gradient_accumulation_steps=4).code_arguments(2)
    with pytest.raises(ConfigError, match="zero_stage=4 is not a DeepSpeed ZeRO stage"):
        DeepSpeedPlugin(zero_stage=4)
    with pytest.raises(ConfigError, match="offload_optimizer_device='disk' is not allowed"):
        DeepSpeedPlugin(offload_optimizer_device="disk")


def test_placeholders_refuse_to_step():
    optim = DummyOptim([{"params": tiny_params(), "weight_decay": 0.0}], lr=0.1)
    assert optim.params[0].keys() == {"params", "weight_decay"}  # torch's defaults are not written into them
    with pytest.raises(RuntimeError, match="placeholder"):
        optim.step()
    with pytest.raises(RuntimeError, match="placeholder"):
        DummyScheduler(optim).step()


def test_a_missing_deepspeed_says_which_extra_to_install(monkeypatch):
    from impel.strategies.deepspeed import import_deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what Python does for an uninstalled package
    with pytest.raises(ImportError, match=r"pip install 'impel\[deepspeed\]'"):
        import_deepspeed(torch.device("cpu"))


def test_import_impel_and_the_deepspeed_names_do_not_import_deepspeed():
    code = ("import sys, impel\nimpel.DeepSpeedPlugin(zero_stage=2)\nimpel.DummyOptim\nimpel.DummyScheduler\n"
            "print('deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("preset", [None, "cpu"])
def test_ds_accelerator_is_set_only_around_the_deepspeed_import(preset):
    """DeepSpeed picks its accelerator from DS_ACCELERATOR once; impel sets it for that moment and puts the user's
    environment back (unset stays unset), so nothing leaks into the rest of the process or its subprocesses."""
    code = ("import os, torch\nfrom impel.strategies.deepspeed import import_deepspeed\n"
            "import_deepspeed(torch.device('cpu'))\nfrom deepspeed.accelerator import get_accelerator\n"
            "print(repr(os.environ.get('DS_ACCELERATOR')), get_accelerator().device_name())")
    environ = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    if preset is not None:
        environ["DS_ACCELERATOR"] = preset
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env=environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == [repr(preset), "cpu"]


def test_a_contradiction_is_found_before_launch(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    config = run_config({"zero_stage": 2, "deepspeed_config_file": str(path)})
    with pytest.raises(ConfigError, match="zero_stage=2 contradicts zero_optimization.stage=3"):
        check_before_launch(config)
    assert config.deepspeed.zero_stage == 2  # the launcher's config is not modified
    check_before_launch(run_config({"deepspeed_config_file": str(path)}))


def test_with_nothing_given_every_auto_gets_a_default():
    resolved, config = resolve({k: v for k, v in ALL_AUTO.items() if k not in ("optimizer", "scheduler")})
    ds = fill_runtime(resolved, micro_batch=3, world=1, optimizer=torch.optim.SGD(tiny_params(), lr=0.1),
                      scheduler=None, has_optimizer=True)
    assert ds["zero_optimization"] == {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False}
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (0.0, 1, 3)
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert config.mixed_precision == "no"
