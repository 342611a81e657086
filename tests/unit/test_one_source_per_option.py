"""One source per option: ``FSDPConfig`` / ``DeepSpeedConfig`` (impel/config/run_config.py) define every FSDP and
DeepSpeed
setting once; the plugin keywords, the YAML keys, the launch flags, the Trainer's ``fsdp_config`` keys, the
questionnaire and the converter are computed from their fields.

For every field (so a field added later is covered without touching this file): each way of setting it arrives at
the same ``RunConfig`` value, and each derived table has exactly the derived key set.
"""
from __future__ import annotations

import io
from dataclasses import MISSING, fields
from typing import Any

import pytest

from impel import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from impel.commands.flags import config_fields, explicit_from_flags_list
from impel.commands.questionnaire import Prompter, run_questionnaire
from impel.config import plugins as plugins_module
from impel.config.convert import convert
from impel.config.mesh_sizes import ParallelismSection
from impel.config.parallelism import ParallelismConfig, TorchContextParallelConfig
from impel.config.plugin_refusals import DEEPSPEED_REFUSED, FSDP_REFUSED
from impel.config.run_config import (
    FALSE_WORDS,
    TRUE_WORDS,
    ConfigError,
    DeepSpeedConfig,
    FSDPConfig,
    RunConfig,
    coerce,
    merge_code_arguments,
    plugin_keyword,
)

SECTIONS = {FSDPConfig: ("fsdp_config", "FSDP", "--use_fsdp"),
            DeepSpeedConfig: ("deepspeed_config", "DEEPSPEED", "--use_deepspeed")}


def _valid(cls: type, name: str, value: Any) -> bool:
    try:
        cls(**{name: value}).validate()
    except ConfigError:
        return False
    return True


def sample(cls: type, f: Any) -> Any:
    """A value for the field that is valid on its own, not the default where one exists."""
    meta = f.metadata
    if meta["choices"] is not None:
        candidates = list(reversed(meta["choices"]))
    elif meta["kind"] == "bool":
        candidates = [f.default is not True, f.default is True]
    elif meta["kind"] == "int":
        candidates = [int(meta["min"] or 0) + 7]
    elif meta["kind"] == "float":
        candidates = [float(meta["min"] or 0) + 0.5]
    else:
        candidates = ["Alpha,Beta" if meta["listed"] else "/sample/path"]
    preferred = [c for c in candidates if c != f.default] + [c for c in candidates if c == f.default]
    return next(c for c in preferred if _valid(cls, f.name, c))


def as_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def section_value(cfg: RunConfig, cls: type, name: str) -> Any:
    section = getattr(cfg, SECTIONS[cls][0])
    assert section is not None
    return getattr(section, name)


def via_yaml(cls: type, name: str, value: Any) -> Any:
    section, kind, _ = SECTIONS[cls]
    cfg = RunConfig.from_dict({"distributed_type": kind, section: {cls.PREFIX + name: value}})
    return section_value(cfg, cls, name)


def via_flag(cls: type, name: str, value: Any) -> Any:
    _, _, switch = SECTIONS[cls]
    explicit = explicit_from_flags_list([switch, f"--{cls.PREFIX}{name}", as_text(value)])
    return section_value(RunConfig.from_dict(explicit), cls, name)


def via_plugin(plugin: Any, cls: type, name: str) -> Any:
    cfg = merge_code_arguments(None, plugin.code_arguments(None))
    assert cls.PREFIX + name in cfg.explicit[SECTIONS[cls][0]]  # it arrives as set, not as a default
    return section_value(cfg, cls, name)


def _params(cls: type) -> list[Any]:
    return [pytest.param(f, id=f.name) for f in fields(cls)]


# --- every field, every way in ------------------------------------------------------------------------------------
@pytest.mark.parametrize("f", _params(FSDPConfig))
def test_every_fsdp_option_arrives_the_same_through_every_spelling(f):
    value = sample(FSDPConfig, f)
    expected = FSDPConfig(**{f.name: value}).validate()
    want = getattr(expected, f.name)
    assert via_yaml(FSDPConfig, f.name, value) == want
    assert via_flag(FSDPConfig, f.name, value) == want
    given = [value.split(",")] if f.metadata["listed"] else []  # code may pass a list of names
    for keyword in (plugin_keyword(f), *f.metadata["also"]):
        for raw in (value, *given):
            plugin = FullyShardedDataParallelPlugin(**{keyword: raw})
            assert via_plugin(plugin, FSDPConfig, f.name) == want, keyword


@pytest.mark.parametrize("f", _params(DeepSpeedConfig))
def test_every_deepspeed_option_arrives_the_same_through_every_spelling(f):
    value = sample(DeepSpeedConfig, f)
    want = getattr(DeepSpeedConfig(**{f.name: value}).validate(), f.name)
    assert via_yaml(DeepSpeedConfig, f.name, value) == want
    assert via_flag(DeepSpeedConfig, f.name, value) == want
    keyword = plugin_keyword(f)
    if keyword is not None:
        assert via_plugin(DeepSpeedPlugin(**{keyword: value}), DeepSpeedConfig, f.name) == want


def test_the_deepspeed_json_path_is_the_plugins_hand_written_hf_ds_config(tmp_path):
    path = str(tmp_path / "ds.json")
    assert via_plugin(DeepSpeedPlugin(hf_ds_config=path), DeepSpeedConfig, "deepspeed_config_file") == path


# --- the tables are computed from the fields ----------------------------------------------------------------------
def _plugin_fields(plugin_cls: type) -> dict[str, Any]:
    return {f.name: f for f in fields(plugin_cls)}


@pytest.mark.parametrize("plugin_cls, cls, table, by_hand", [
    (FullyShardedDataParallelPlugin, FSDPConfig, "_FSDP_KEYS", {"cpu_offload", "mixed_precision_policy",
                                                                *FSDP_REFUSED}),
    (DeepSpeedPlugin, DeepSpeedConfig, "_DEEPSPEED_KEYS", {"hf_ds_config", "gradient_accumulation_steps",
                                                           "is_train_batch_min", *DEEPSPEED_REFUSED}),
], ids=["fsdp", "deepspeed"])
def test_plugin_keywords_are_computed_from_the_config_fields(plugin_cls, cls, table, by_hand):
    derived = {plugin_keyword(f): f.name for f in fields(cls) if plugin_keyword(f) is not None}
    generated = {name: f.metadata["config"] for name, f in _plugin_fields(plugin_cls).items() if "config" in f.metadata}
    assert generated == derived
    assert getattr(plugins_module, table) == derived
    assert set(_plugin_fields(plugin_cls)) == set(derived) | by_hand
    for f in fields(cls):
        assert set(f.metadata["also"]) <= by_hand  # a second keyword of an option is one the class writes by hand


# Accelerate 1.15's plugin fields (checked against the installed Accelerate below, when there is one)
ACCELERATE_FIELDS = {
    "FullyShardedDataParallelPlugin": (
        "fsdp_version", "sharding_strategy", "reshard_after_forward", "backward_prefetch", "mixed_precision_policy",
        "auto_wrap_policy", "cpu_offload", "ignored_modules", "state_dict_type", "state_dict_config",
        "optim_state_dict_config", "limit_all_gathers", "use_orig_params", "param_init_fn", "sync_module_states",
        "forward_prefetch", "activation_checkpointing", "activation_checkpointing_offload",
        "cpu_ram_efficient_loading", "transformer_cls_names_to_wrap", "min_num_params"),
    "DeepSpeedPlugin": (
        "hf_ds_config", "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "is_train_batch_min",
        "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
        "zero3_init_flag", "zero3_save_16bit_model", "transformer_moe_cls_names", "enable_msamp", "msamp_opt_level"),
}


@pytest.mark.parametrize("plugin_cls", [FullyShardedDataParallelPlugin, DeepSpeedPlugin])
def test_plugin_keywords_are_accelerates(plugin_cls):
    """The names Accelerate users pass: every keyword of impel's plugin is a field of Accelerate's plugin of the same
    name (``offload_params``, the YAML key's name, is impel's own spelling of ``cpu_offload``), in Accelerate's
    relative order where Accelerate's order and the config's agree (DeepSpeed: all of them)."""
    theirs = ACCELERATE_FIELDS[plugin_cls.__name__]
    ours = [name for name in _plugin_fields(plugin_cls) if name != "offload_params"]
    assert set(ours) <= set(theirs), sorted(set(ours) - set(theirs))
    if plugin_cls is DeepSpeedPlugin:
        assert ours == [name for name in theirs if name in ours]  # positional arguments work as in Accelerate


def test_accelerate_fields_are_the_installed_accelerates():
    accelerate = pytest.importorskip("accelerate")
    if not accelerate.__version__.startswith("1.15."):
        pytest.skip(f"the table is Accelerate 1.15's; Accelerate {accelerate.__version__} is installed")
    import accelerate.utils

    for name, expected in ACCELERATE_FIELDS.items():
        assert tuple(f.name for f in fields(getattr(accelerate.utils, name))) == expected


def test_flags_and_yaml_keys_cover_every_field():
    for cls, (section, _, _) in SECTIONS.items():
        derived = {cls.PREFIX + f.name for f in fields(cls)}
        assert {key for s, key, _, _ in config_fields() if s == section} == derived
        assert {flag for s, _, flag, _ in config_fields() if s == section} == derived


def test_the_fsdp_questions_are_the_fields_with_a_question():
    asked: list[str] = []
    out = io.StringIO()
    answers = run_questionnaire(Prompter(io.StringIO("FSDP\n1\n2\n" + "\n" * 40), out), lambda kind: 2)
    for line in out.getvalue().splitlines():
        for f in fields(FSDPConfig):
            if f.metadata["question"] and line.startswith(f.metadata["question"] + " ") and f.name not in asked:
                asked.append(f.name)
    with_question = [f.name for f in fields(FSDPConfig) if f.metadata["question"] and (
        f.metadata["ask_if"] is None or f.metadata["ask_if"][1] == _suggested(f.metadata["ask_if"][0]))]
    assert asked == with_question
    assert set(answers["fsdp_config"]) == {FSDPConfig.PREFIX + n for n in with_question
                                           if _suggested(n) is not None}


def _suggested(name: str) -> Any:
    return next(f.metadata["suggest"] for f in fields(FSDPConfig) if f.name == name)


@pytest.mark.parametrize("f", _params(FSDPConfig))
def test_every_fsdp_key_is_translated_to_deepspeed_or_noted(f):
    value = sample(FSDPConfig, f)
    base = {"distributed_type": "FSDP"}
    given = {**base, "fsdp_config": {FSDPConfig.PREFIX + f.name: value}}
    without, _ = convert(base, "deepspeed")
    with_it, notes = convert(given, "deepspeed")
    noted = any(note.startswith(FSDPConfig.PREFIX + f.name + ":") for note in notes)
    assert (with_it != without) or noted
    assert noted == bool(f.metadata["deepspeed_note"])


# --- one table of words for a bool --------------------------------------------------------------------------------
@pytest.mark.parametrize("word", TRUE_WORDS + FALSE_WORDS + tuple(w.upper() for w in TRUE_WORDS + FALSE_WORDS))
def test_flags_and_prompts_take_the_same_bool_words(word):
    meta = next(f.metadata for f in fields(FSDPConfig) if f.name == "forward_prefetch")
    expected = word.lower() in TRUE_WORDS
    assert coerce("--fsdp_forward_prefetch", word, meta, from_text=True) is expected
    explicit = explicit_from_flags_list(["--use_fsdp", "--fsdp_forward_prefetch", word])
    assert explicit["fsdp_config"]["fsdp_forward_prefetch"] is expected


def test_defaults_of_generated_plugin_keywords_mean_not_set():
    for plugin_cls in (FullyShardedDataParallelPlugin, DeepSpeedPlugin):
        for f in fields(plugin_cls):
            if "config" in f.metadata:
                assert f.default is None and f.default_factory is MISSING


# --- N-D parallelism: the parallelism_config section --------------------------------------------------------------
def _mesh_sample(f: Any) -> Any:
    """A value valid on its own for a ParallelismSection field (sizes: 2, except sp_size, which must stay 1)."""
    if f.metadata["kind"] == "int":
        return 2 if f.name != "sp_size" else 1
    return f.metadata["choices"][-1]


@pytest.mark.parametrize("f", _params(ParallelismSection))
def test_every_parallelism_option_arrives_the_same_through_every_spelling(f):
    value = _mesh_sample(f)
    key, shard = ParallelismSection.PREFIX + f.name, ParallelismSection.PREFIX + "dp_shard_size"
    via_file = RunConfig.from_dict({"distributed_type": "FSDP", "parallelism_config": {shard: 2, key: value}})
    explicit = explicit_from_flags_list(["--use_fsdp", f"--{shard}", "2", f"--{key}", as_text(value)])
    assert getattr(via_file.parallelism_config, f.name) == value
    assert getattr(RunConfig.from_dict(explicit).parallelism_config, f.name) == value
    code = (ParallelismConfig(dp_shard_size=2, cp_handler=TorchContextParallelConfig(value))
            if f.name == "cp_comm_strategy" else ParallelismConfig(**{"dp_shard_size": 2, f.name: value}))
    cfg = merge_code_arguments(None, {"distributed_type": "FSDP", **code.code_arguments()})
    assert key in cfg.explicit["parallelism_config"]  # it arrives as set, not as a default
    assert getattr(cfg.parallelism_config, f.name) == value


def test_parallelism_config_keywords_are_generated_from_the_section():
    generated = {f.name: f.metadata["config"] for f in fields(ParallelismConfig) if "config" in f.metadata}
    assert generated == {kw: f.name for f in fields(ParallelismSection) if (kw := plugin_keyword(f)) is not None}
    assert {f.name for f in fields(ParallelismConfig)} - set(generated) == {"tp_handler", "cp_handler", "sp_handler"}
