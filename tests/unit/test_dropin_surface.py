"""Accelerate's public surface after ``sed 's/\\baccelerate\\b/impel/g'``: module paths, names, enums compared with
Accelerate's, the compatibility table, and the clear errors for what impel does not drive."""
from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

import impel
import impel.state
from impel import Accelerator, ConfigError

ROOT = Path(__file__).resolve().parents[2]

# What renamed scripts import (accelerate's examples, transformers' *_no_trainer.py, diffusers / trl scripts).
RENAMED_IMPORTS = {
    "impel": ["Accelerator", "DistributedType", "PartialState", "DataLoaderConfiguration", "DeepSpeedPlugin",
              "FullyShardedDataParallelPlugin", "DistributedDataParallelKwargs", "GradScalerKwargs",
              "InitProcessGroupKwargs", "AutocastKwargs", "ProfileKwargs", "DDPCommunicationHookType",
              "find_executable_batch_size", "notebook_launcher", "debug_launcher", "init_empty_weights",
              "init_on_device", "load_checkpoint_in_model", "synchronize_rng_states", "skip_first_batches",
              "is_rich_available"],
    # Accelerate's public module paths, renamed (never impel's internal ones: the layout may move, these may not)
    "impel.accelerator": ["Accelerator", "AcceleratorState", "GradientState", "DataLoaderConfiguration"],
    "impel.state": ["PartialState", "AcceleratorState", "GradientState"],
    "impel.logging": ["get_logger", "MultiProcessAdapter"],
    "impel.data_loader": ["skip_first_batches", "DataLoaderShard", "prepare_data_loader"],
    "impel.big_modeling": ["init_empty_weights", "init_on_device"],
    "impel.launchers": ["notebook_launcher", "debug_launcher"],
    "impel.local_sgd": ["LocalSGD"],
    "impel.optimizer": ["AcceleratedOptimizer"],
    "impel.scheduler": ["AcceleratedScheduler"],
    "impel.tracking": ["GeneralTracker", "on_main_process", "register_tracker_class", "TensorBoardTracker"],
    "impel.parallelism_config": ["ParallelismConfig"],
    "impel.commands.config": ["default_config_file", "load_config_from_file"],
    "impel.utils.dataclasses": ["DistributedType", "FullyShardedDataParallelPlugin", "DistributedDataParallelKwargs"],
    "impel.utils.operations": ["gather_object", "send_to_device"],
    "impel.utils.memory": ["find_executable_batch_size", "release_memory"],
    "impel.utils.random": ["set_seed"],
    "impel.utils": ["set_seed", "DistributedType", "ProjectConfiguration", "DistributedDataParallelKwargs",
                    "InitProcessGroupKwargs", "GradientAccumulationPlugin", "DataLoaderConfiguration",
                    "FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "GradScalerKwargs", "AutocastKwargs",
                    "ProfileKwargs", "DDPCommunicationHookType", "KwargsHandler", "gather", "gather_object",
                    "broadcast", "broadcast_object_list", "reduce", "pad_across_processes", "send_to_device",
                    "recursively_apply", "wait_for_everyone", "tqdm", "LoggerType", "PrecisionType", "RNGType",
                    "DummyOptim", "DummyScheduler", "merge_fsdp_weights", "release_memory",
                    "find_executable_batch_size", "synchronize_rng_state", "synchronize_rng_states", "save",
                    "load_checkpoint_in_model", "is_tensorboard_available", "is_wandb_available",
                    "is_deepspeed_available", "is_transformers_available", "is_npu_available", "is_xpu_available",
                    "is_torch_xla_available", "is_mps_available", "is_bf16_available", "is_rich_available",
                    "is_schedulefree_available", "is_peft_available", "is_datasets_available"],
}


@pytest.mark.parametrize("module,name", [(m, n) for m, names in RENAMED_IMPORTS.items() for n in names])
def test_renamed_import_resolves(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_the_renamed_imports_are_accelerates_public_paths():
    """Each module above is one of Accelerate's, renamed: the test guards what users import, not impel's layout."""
    pytest.importorskip("accelerate")
    for module in RENAMED_IMPORTS:
        theirs = importlib.import_module(module.replace("impel", "accelerate", 1))
        assert all(hasattr(theirs, name) for name in RENAMED_IMPORTS[module]), module


def test_faces_list_their_names_and_reject_unknown_ones():
    utils = importlib.import_module("impel.utils")
    assert set(dir(utils)) == set(utils.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        utils.no_such_name  # noqa: B018


def _supported_rows() -> list[tuple[str, str]]:
    doc = (ROOT / "docs" / "accelerate-compatibility.md").read_text(encoding="utf-8")
    section, rows = "", []
    for line in doc.splitlines():
        if line.startswith("## "):
            section = line
        match = re.match(r"\| `([A-Za-z_0-9]+)` \| supported \|", line)
        if match:
            rows.append((section, match.group(1)))
    return rows


def test_every_supported_row_of_the_compatibility_table_resolves():
    rows = _supported_rows()
    assert len(rows) > 100
    acc = Accelerator(cpu=True)
    utils = importlib.import_module("impel.utils")
    params = set(inspect.signature(Accelerator.__init__).parameters)
    for section, name in rows:
        if "Top-level" in section:
            assert hasattr(impel, name), name
        elif "accelerate.utils" in section:
            assert hasattr(utils, name), name
        elif "arguments" in section:
            assert name in params, name
        elif "State classes" in section:
            assert hasattr(impel.state.PartialState, name), name
        else:  # listed, not read: some properties raise without their setting (tensor_parallel_rank), as Accelerate's
            assert name in dir(acc), name


def test_accelerate_top_level_names_exist_or_are_listed_as_missing():
    accelerate = pytest.importorskip("accelerate")
    doc = (ROOT / "docs" / "accelerate-compatibility.md").read_text(encoding="utf-8")
    for name in dir(accelerate):
        if name.startswith("_") or isinstance(getattr(accelerate, name), types.ModuleType):
            continue
        assert hasattr(impel, name) or f"| `{name}` | missing" in doc, name


# --- enums ----------------------------------------------------------------------------------------------------
def test_distributed_type_has_accelerates_members():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from impel.utils import DistributedType

    ours = {m.name: m.value for m in DistributedType if m.name != "AUTO"}
    assert ours == {m.name: m.value for m in accelerate_utils.DistributedType}
    acc = Accelerator(cpu=True)
    assert acc.distributed_type != DistributedType.XLA
    assert acc.distributed_type == DistributedType.NO == "NO"


@pytest.mark.parametrize("kind", ["XLA", "MULTI_NPU", "MEGATRON_LM", "MULTI_XPU", "MULTI_HPU"])
def test_selecting_hardware_impel_does_not_drive_raises_clearly(kind):
    from impel.config.run_config import RunConfig

    with pytest.raises(ConfigError, match=rf"distributed_type='{kind}' selects .* impel does not drive; impel runs "
                                          r"NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED"):
        RunConfig.from_dict({"distributed_type": kind})


def test_a_launched_unsupported_distributed_type_stops_the_accelerator(monkeypatch):
    monkeypatch.setenv("IMPEL_CONFIG", '{"distributed_type": "XLA"}')
    with pytest.raises(ConfigError, match="TPUs through torch_xla"):
        Accelerator(cpu=True)


def test_value_enums_match_accelerate():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    import impel.utils as ours

    for name in ("PrecisionType", "RNGType", "LoggerType", "DDPCommunicationHookType"):
        theirs = {m.name: m.value for m in getattr(accelerate_utils, name)}
        assert {m.name: m.value for m in getattr(ours, name)} == theirs, name
        assert str(getattr(ours, name).__members__[next(iter(theirs))]) == next(iter(theirs.values()))


def test_logger_type_is_accepted_by_log_with(tmp_path):
    from impel.utils import LoggerType

    acc = Accelerator(cpu=True, log_with=[LoggerType.ALL], project_dir=str(tmp_path))
    assert all(isinstance(n, str) and not isinstance(n, LoggerType) for n in acc.log_with)
    with pytest.raises(ConfigError, match="'aim' is not a tracker impel knows"):
        Accelerator(cpu=True, log_with=LoggerType.AIM)


def test_fp8_is_a_name_but_not_a_mode():
    from impel.utils import PrecisionType, is_fp8_available

    assert PrecisionType.FP8 == "fp8" and not is_fp8_available()
    with pytest.raises(ConfigError, match="mixed_precision='fp8'"):
        Accelerator(cpu=True, mixed_precision=PrecisionType.FP8)
