"""ParallelismConfig without ranks: Accelerate's fields and properties, validation and its texts, the YAML section and
launch flags (Accelerate's spellings, one definition), settlement against the world size and the strategy, and data
sharding over the data-parallel dims only."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel import ConfigError, DataLoaderConfiguration, GradientAccumulationPlugin, ParallelismConfig, RunConfig
from impel.accelerator.resolve import RunArguments, resolve
from impel.commands.flags import config_fields, explicit_from_flags_list
from impel.config.convert import convert
from impel.config.environment import Topology
from impel.config.mesh_sizes import ParallelismSection
from impel.config.parallelism import TorchContextParallelConfig, TorchTensorParallelConfig, settle
from impel.config.yaml_file import read_config_file
from impel.runtime.loaders.data import shard_dataloader
from impel.runtime.step.accumulation import GradientState

ACCELERATE_FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend",
                     "tp_handler", "cp_handler", "sp_handler")


def test_fields_and_order_are_accelerates():
    assert tuple(f.name for f in dataclasses.fields(ParallelismConfig)) == ACCELERATE_FIELDS
    accelerate = pytest.importorskip("accelerate")
    if accelerate.__version__.startswith("1.15."):
        from accelerate.parallelism_config import ParallelismConfig as Theirs

        assert tuple(f.name for f in dataclasses.fields(Theirs)) == ACCELERATE_FIELDS


def test_public_paths():
    import impel
    import impel.utils

    assert impel.ParallelismConfig is ParallelismConfig
    assert impel.utils.ParallelismConfig is ParallelismConfig
    assert impel.utils.TorchTensorParallelConfig is TorchTensorParallelConfig
    assert impel.utils.TorchContextParallelConfig is TorchContextParallelConfig


def test_defaults_and_properties():
    pc = ParallelismConfig()
    assert pc.sizes() == {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 1, "sp_size": 1}
    assert (pc.cp_backend, pc.sp_backend, pc.tp_handler, pc.cp_handler) == ("torch", "deepspeed", None, None)
    assert pc.total_size == 1 and pc.active_mesh_dims == [] and pc._get_mesh() == ()

    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=3, tp_size=2, cp_size=2)
    assert pc.dp_dim_names == ["dp_replicate", "dp_shard"] and pc.non_dp_dim_names == ["tp", "cp"]
    assert pc.dp_shard_cp_dim_names == ["dp_shard", "cp"] and pc.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert (pc.total_size, pc.data_parallel_size, pc.non_data_parallel_size) == (24, 6, 4)
    assert (pc.dp_replicate_enabled, pc.dp_shard_enabled, pc.tp_enabled, pc.cp_enabled, pc.sp_enabled) == (
        True, True, True, True, False)
    assert pc._get_mesh() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 3, 2, 2))  # torchtitan's order
    assert isinstance(pc.tp_handler, TorchTensorParallelConfig) and pc.cp_handler.cp_comm_strategy == "allgather"
    assert ParallelismConfig(dp_shard_size=2, tp_size=2).fsdp_dim_names == ["dp_shard_cp"]


def test_data_parallel_coordinates_put_tp_and_cp_ranks_of_one_batch_together():
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=1, tp_size=2)
    assert [pc.data_parallel_coordinates(r) for r in range(8)] == [(r // 2, 4) for r in range(8)]
    pc = ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)  # mesh (dp_shard, cp, tp): 4 ranks per batch
    assert [pc.data_parallel_coordinates(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tp_size": 0}, "tp_size=0 must be an integer >= 1"),
    ({"dp_shard_size": "2"}, "dp_shard_size='2' must be an integer >= 1"),
    ({"cp_backend": "ring"}, "cp_backend='ring' is not allowed; use one of 'torch'"),
    ({"sp_size": 2}, "sp_size=2: DeepSpeed sequence parallelism (Ulysses / ALST, Accelerate's sp_backend='deepspeed') "
                     "is not supported by impel"),
    ({"dp_replicate_size": 2, "tp_size": 2}, "dp_replicate_size=2 with dp_shard_size=1 and tp_size=2, cp_size=1 is not "
                                             "a valid mesh: tensor/context parallelism composes with FSDP"),
    ({"dp_replicate_size": 2, "cp_size": 2}, "set dp_shard_size=2 and dp_replicate_size=1 for FSDP x TP (2-D)"),
    ({"tp_handler": TorchContextParallelConfig()},
     "ParallelismConfig(tp_handler=TorchContextParallelConfig(cp_comm_strategy='allgather')) must be a "
     "TorchTensorParallelConfig"),
    ({"sp_handler": object()}, "DeepSpeed sequence parallelism is not supported by impel"),
])
def test_invalid_configs_are_named(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        ParallelismConfig(**kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"enable_async_tp": True}, "enable_async_tp=True) is not supported"),
    ({"tp_plan": {"fc1": "colwize"}}, "tp_plan['fc1']='colwize' is not a style impel applies; use one of colwise,"),
    ({"tp_plan": {}}, "tp_plan={} must be a non-empty dict of module path -> style"),
])
def test_tensor_parallel_config_checks_its_plan(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        TorchTensorParallelConfig(**kwargs)
    assert fragment in str(err.value)


def test_context_parallel_comm_strategy():
    assert TorchContextParallelConfig("alltoall").cp_comm_strategy == "alltoall"
    with pytest.raises(ConfigError, match="cp_comm_strategy='ring' is not allowed; use one of 'allgather', 'alltoall'"):
        TorchContextParallelConfig("ring")


def test_accelerates_environment_variables_fill_unset_sizes(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert (pc.tp_size, pc.dp_shard_size, pc.cp_handler.cp_comm_strategy) == (2, 2, "alltoall")
    assert ParallelismConfig(tp_size=4).tp_size == 4  # a keyword beats the variable
    assert pc.code_arguments() == {"parallelism_config": {
        "parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2, "parallelism_config_tp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall"}}
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ConfigError, match="tp_size='two' must be an integer"):
        ParallelismConfig()


def test_the_launched_section_reaches_the_code_as_accelerates_variables(tmp_path, monkeypatch):
    """``impel launch --parallelism_config_*`` exports Accelerate's ``PARALLELISM_CONFIG_*`` variables (as
    ``accelerate launch`` does); a ``ParallelismConfig()`` built in the script reads them, not the launch config."""
    plan = _plan(tmp_path, "--use_fsdp", "--num_processes", "4", "--parallelism_config_dp_shard_size", "2",
                 "--parallelism_config_tp_size", "2", "--parallelism_config_cp_comm_strategy", "alltoall")
    exported = {k: v for k, v in plan.rank_variables.items() if k.startswith("PARALLELISM_CONFIG_")}
    assert exported == {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
                        "PARALLELISM_CONFIG_TP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "1",
                        "PARALLELISM_CONFIG_CP_BACKEND": "torch", "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall",
                        "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    assert not any(k.startswith("PARALLELISM_CONFIG_") for k in _plan(tmp_path).rank_variables)
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    pc = ParallelismConfig(tp_size=4)  # a keyword still beats the launched value
    assert (pc.dp_shard_size, pc.tp_size) == (2, 4)
    # the launch config alone (no variables) no longer reaches ParallelismConfig: resolve reads it, once
    for name in exported:
        monkeypatch.delenv(name)
    monkeypatch.setenv("IMPEL_CONFIG", json.dumps({"parallelism_config": {"parallelism_config_dp_shard_size": 2}}))
    assert ParallelismConfig().dp_shard_size == 1


def _plan(tmp_path, *flags):
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    (tmp_path / "train.py").write_text("")
    argv = ["launch", "--cpu", *flags, str(tmp_path / "train.py")]
    return plan_launch(build_parser().parse_args(bool_values_joined(argv)))


# --- YAML, flags, impel config, the converter --------------------------------------------------------------------
def test_yaml_section_and_flags_are_accelerates_spelling(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nparallelism_config:\n"
                    "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n"
                    "  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n")
    from_file = RunConfig.from_dict(read_config_file(str(path)))
    flags = explicit_from_flags_list(["--use_fsdp", "--num_processes", "8", "--use_parallelism_config",
                                      "--parallelism_config_dp_replicate_size", "2",
                                      "--parallelism_config_dp_shard_size", "2", "--parallelism-config-tp-size", "2",
                                      "--parallelism_config_cp_size", "1"])
    assert RunConfig.from_dict(flags).parallelism_config == from_file.parallelism_config
    assert from_file.parallelism_config.sizes() == {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2,
                                                    "cp_size": 1, "sp_size": 1}
    round_trip = RunConfig.from_dict(from_file.to_dict(explicit_only=True))
    assert round_trip.parallelism_config == from_file.parallelism_config
    assert RunConfig.from_dict({"parallelism_config": {}}).parallelism_config is None  # Accelerate writes {}


def test_every_flag_is_one_of_accelerates_launch_flags():
    ours = {flag for section, _, flag, _ in config_fields() if section == "parallelism_config"}
    assert ours == {ParallelismSection.PREFIX + f.name for f in dataclasses.fields(ParallelismSection)}
    accelerate = pytest.importorskip("accelerate")
    if not accelerate.__version__.startswith("1.15."):
        pytest.skip("the flags are Accelerate 1.15's")
    from accelerate.commands.launch import launch_command_parser

    theirs = {a.dest for a in launch_command_parser()._actions}
    assert ours <= theirs and "use_parallelism_config" in theirs


@pytest.mark.parametrize("explicit, fragment", [
    ({"num_processes": 4, "parallelism_config": {"parallelism_config_tp_size": 3}},
     "parallelism_config: dp_replicate_size=1, dp_shard_size=1, tp_size=3, cp_size=1, sp_size=1 multiply to 3, but "
     "num_processes=4; the product of the sizes must equal the number of processes"),
    ({"num_processes": 4, "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                                                 "parallelism_config_tp_size": 2}},
     "parallelism_config dp_shard_size=2 needs FSDP (it shards the model over the dp_shard x cp ranks), but "
     "distributed_type=None; launch with --use_fsdp"),
    ({"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_tp_size": 2}},
     "distributed_type FSDP with parallelism_config dp_replicate_size=1, dp_shard_size=1, tp_size=2, cp_size=1, "
     "sp_size=1 leaves FSDP no dimension to shard over"),
    ({"distributed_type": "DEEPSPEED", "parallelism_config": {"parallelism_config_tp_size": 2}},
     "does not compose with DeepSpeed in impel; use FSDP (--use_fsdp)"),
])
def test_the_launch_config_is_checked_before_any_rank_starts(explicit, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(explicit)
    assert fragment in str(err.value)


def test_impel_launch_checks_the_product_against_the_processes_it_starts(tmp_path):
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["launch", "--config_file", str(tmp_path / "none.yaml"), "--cpu", "--num_processes", "2",
            "--parallelism_config_tp_size", "4", str(script)]
    (tmp_path / "none.yaml").write_text("{}\n")
    ns = build_parser().parse_args(bool_values_joined(argv))
    with pytest.raises(ConfigError, match="tp_size=4, cp_size=1, sp_size=1 multiply to 4, but num_processes=2"):
        plan_launch(ns)
    argv[argv.index("4")] = "2"
    assert plan_launch(build_parser().parse_args(bool_values_joined(argv))).explicit["parallelism_config"] == {
        "parallelism_config_tp_size": 2}


def test_impel_config_asks_for_the_sizes():
    import io

    from impel.commands.questionnaire import Prompter, run_questionnaire

    answers = "MULTI_CPU\n1\n2\n\n\nyes\n1\n1\n2\n1\n"  # ..., precision, accumulation, mesh?, sizes
    out = run_questionnaire(Prompter(io.StringIO(answers), io.StringIO()), lambda kind: 2)
    assert out["parallelism_config"] == {"parallelism_config_dp_replicate_size": 1,
                                         "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 2,
                                         "parallelism_config_cp_size": 1}
    RunConfig.from_dict(out)
    with pytest.raises(ConfigError, match="multiply to 4, but num_processes=2"):
        run_questionnaire(Prompter(io.StringIO("MULTI_CPU\n1\n2\n\n\nyes\n1\n1\n4\n1\n"), io.StringIO()),
                          lambda kind: 2)
    no_mesh = run_questionnaire(Prompter(io.StringIO("MULTI_CPU\n1\n2\n\n\n\n"), io.StringIO()), lambda kind: 2)
    assert "parallelism_config" not in no_mesh


def test_converting_to_deepspeed_drops_the_mesh_with_a_note():
    explicit = {"distributed_type": "FSDP", "num_processes": 4,
                "parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}}
    out, notes = convert(explicit, "deepspeed")
    assert "parallelism_config" not in out
    assert any(n.startswith("parallelism_config: impel runs no tensor / context parallelism") for n in notes)


# --- settled against the world size (resolve, then build) ------------------------------------------------------
def _record(world: int, rank: int = 0, **kwargs):
    args = RunArguments(cpu=True, **kwargs)
    return resolve(None, args, Topology(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=1))


def test_resolve_settles_the_sizes_against_the_world_size():
    record = _record(4, parallelism_config=ParallelismConfig(tp_size=4))
    assert record.parallelism.sizes()["tp_size"] == 4 and record.config.parallelism_config.tp_size == 4
    with pytest.raises(ConfigError) as err:
        _record(4, parallelism_config=ParallelismConfig(tp_size=2))
    assert str(err.value).startswith("parallelism_config: dp_replicate_size=1, dp_shard_size=1, tp_size=2, cp_size=1, "
                                     "sp_size=1 multiply to 2, but WORLD_SIZE=4")
    given = ParallelismConfig()
    plain = _record(4, parallelism_config=given)  # all 1: every rank data parallel, as Accelerate
    assert plain.parallelism.dp_replicate_size == 4 and plain.parallelism.active_mesh_dims == ["dp_replicate"]
    assert plain.parallelism is given  # the object passed in is the run's, settled in place (as Accelerate's)


def test_settle_checks_the_fsdp_sharding_strategy():
    section = ParallelismSection(dp_shard_size=2, tp_size=2)
    assert settle(section, None, 4, "FSDP", "FULL_SHARD").fsdp_dim_names == ["dp_shard_cp"]
    with pytest.raises(ConfigError, match="fsdp_sharding_strategy='HYBRID_SHARD' replicates over dp_replicate_size"):
        settle(section, None, 4, "FSDP", "HYBRID_SHARD")
    with pytest.raises(ConfigError, match="fsdp_sharding_strategy='NO_SHARD' has no place in a parallelism_config"):
        settle(section, None, 4, "FSDP", "NO_SHARD")
    assert settle(None, ParallelismConfig(), 4, "FSDP", "FULL_SHARD").dp_shard_size == 4
    assert settle(None, None, 4, "FSDP", "FULL_SHARD") is None


def test_an_accelerate_launch_turns_the_config_on(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert _record(2).parallelism.tp_size == 2


# --- data: TP / CP ranks of one data-parallel rank read the same batches ----------------------------------------
@pytest.mark.parametrize("sizes", [{"tp_size": 2}, {"dp_shard_size": 2, "tp_size": 2},
                                   {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}])
def test_data_shards_over_the_data_parallel_dims_only(sizes):
    world = 1
    for v in sizes.values():
        world *= v
    per_rank = 2
    seen = []
    for rank in range(world):
        pc = _record(world, rank, parallelism_config=ParallelismConfig(**sizes),
                     fsdp_plugin=_fsdp() if "dp_shard_size" in sizes else None).parallelism
        dp_rank, dp_size = pc.data_parallel_coordinates(rank)
        loader = DataLoader(IndexDataset(24), batch_size=per_rank, shuffle=True,
                            generator=torch.Generator().manual_seed(3))
        shard = shard_dataloader(loader, world=dp_size, rank=dp_rank, device=None, config=DataLoaderConfiguration(),
                                 gradient_state=GradientState(GradientAccumulationPlugin()))
        seen.append([b.flatten().tolist() for b in shard])
    tp = sizes["tp_size"]
    for rank in range(world):
        assert seen[rank] == seen[rank - rank % tp]  # a TP group reads one stream
    heads = [seen[r] for r in range(0, world, tp)]
    flat = sorted(i for stream in heads for batch in stream for i in batch)
    assert flat == list(range(24))  # the data-parallel ranks split the epoch: each sample once


def _fsdp():
    from impel import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin()


def test_a_launched_section_reaches_a_script_that_passes_none():
    launched = {"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                                                                   "parallelism_config_tp_size": 2}}
    record = resolve(launched, RunArguments(cpu=True),
                     Topology(rank=3, world_size=4, master_addr="127.0.0.1", master_port=1))
    assert record.parallelism.sizes()["dp_shard_size"] == 2 and record.parallelism.tp_size == 2
    assert record.parallelism.data_parallel_coordinates(3) == (1, 2)


def test_one_process_ranks_and_mesh():
    from impel import Accelerator

    acc = Accelerator(cpu=True)
    assert acc.parallelism_config is None and acc.torch_device_mesh is None
    with pytest.raises(RuntimeError, match="Tensor parallelism is not configured; pass Accelerator"):
        acc.tensor_parallel_rank  # noqa: B018 - Accelerate's property raises the same way
    acc = Accelerator(cpu=True, parallelism_config=ParallelismConfig())
    assert acc.torch_device_mesh is None and acc.parallelism_config.total_size == 1
    assert (acc.tensor_parallel_rank, acc.data_parallel_rank, acc.data_parallel_shard_rank) == (0, 0, 0)
    with pytest.raises(NotImplementedError):
        acc.pipeline_parallel_rank  # noqa: B018
