"""Elastic jobs before any rank starts: ``--nnodes MIN:MAX`` becomes torchrun's elastic c10d arguments, and each
rank's accumulation keeps the planned global batch on the world it gets (the end-to-end run with a machine lost
is tests/cli/test_elastic.py)."""
from __future__ import annotations

import json

import pytest

from impel import Accelerator, ConfigError, GradientAccumulationPlugin, ProjectConfiguration
from impel.accelerator.resolve import resolve
from impel.commands.flags import bool_values_joined
from impel.commands.launch import plan_launch
from impel.commands.main import build_parser
from impel.config import environment as env
from impel.config.elastic import scaled_accumulation, smallest_steps
from impel.config.environment import Topology
from impel.runtime.step.run_record import RunArguments
from impel.testing import free_port


def _plan(tmp_path, *flags):
    (tmp_path / "train.py").write_text("")
    argv = ["launch", "--cpu", *flags, str(tmp_path / "train.py")]
    return plan_launch(build_parser().parse_args(bool_values_joined(argv)))


@pytest.mark.parametrize("rank,conf,expected", [("0", None, "is_host=1"), ("1", None, "is_host=0"),
                                                ("1", "last_call_timeout=5", "is_host=0,last_call_timeout=5"),
                                                ("1", "is_host=1", "is_host=1")])
def test_nnodes_min_max_is_an_elastic_c10d_launch_hosted_by_machine_0(tmp_path, rank, conf, expected):
    port = str(free_port())
    extra = ["--rdzv_conf", conf] if conf else []
    plan = _plan(tmp_path, "--nnodes", "1:2", "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                 "--node_rank", rank, "--max_restarts", "3", *extra)  # torchrun's spelling of --machine_rank
    assert plan.explicit["min_machines"] == 1 and plan.explicit["num_machines"] == 2
    assert plan.config.machine_rank == int(rank)
    args = plan.torchrun_args
    assert args[args.index("--nnodes") + 1] == "1:2" and args[args.index("--max_restarts") + 1] == "3"
    assert args[args.index("--rdzv_backend") + 1] == "c10d"
    assert args[args.index("--rdzv_endpoint") + 1] == f"127.0.0.1:{port}"
    assert args[args.index("--rdzv_conf") + 1] == expected
    assert "--node_rank" not in args  # c10d hands out the ranks
    variables = env.launch_environment(plan.explicit, None, None)
    assert variables["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # no store left on a lost machine


def test_nnodes_alone_is_num_machines_and_a_fixed_job_stays_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    plan = _plan(tmp_path, "--nnodes", "2", "--machine_rank", "1", "--main_process_ip", "127.0.0.1")
    assert plan.config.num_machines == 2 and plan.config.min_machines is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env.launch_environment(plan.explicit, None, None)
    args = plan.torchrun_args
    assert args[args.index("--nnodes") + 1] == "2" and "--rdzv_conf" not in args


@pytest.mark.parametrize("steps,planned,world,scaled", [(1, 2, 1, 2), (2, 4, 2, 4), (3, 4, 4, 3), (1, 4, 2, 2)])
def test_the_accumulation_keeps_micro_x_steps_x_world(steps, planned, world, scaled):
    assert scaled_accumulation(steps, planned, world) == scaled
    assert scaled * world == steps * planned


def test_an_accumulation_that_cannot_keep_the_batch_names_the_numbers():
    with pytest.raises(ConfigError, match=r"elastic job on 2 of its 3 planned processes: gradient accumulation 1 x 3 "
                                          r"/ 2 is not a whole number.*a multiple of 2\)"):
        scaled_accumulation(1, 3, 2)
    assert smallest_steps(1, 2) == 1 and smallest_steps(2, 3) == 2 and smallest_steps(1, 4) == 3  # 3 x 4 / 3 = 4


def _launched(**keys):
    return {"min_machines": 1, "num_machines": 2, "main_process_ip": "127.0.0.1", "use_cpu": True,
            "auto_resume": True, **keys}


@pytest.mark.parametrize("plugin", [False, True])
def test_a_rank_of_a_shrunk_job_raises_its_accumulation(plugin):
    """One process left of two planned: accumulation 2 -> 4, also when the code passed a plugin."""
    args = RunArguments(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2)) if plugin else \
        RunArguments(gradient_accumulation_steps=2)
    record = resolve(_launched(), args, Topology(world_size=1, local_world_size=1))
    assert record.config.gradient_accumulation_steps == 4 and record.accumulation.num_steps == 4
    full = resolve(_launched(), RunArguments(gradient_accumulation_steps=2), Topology(world_size=2, rank=0,
                                                                                       local_world_size=1))
    assert full.accumulation.num_steps == 2


def test_a_world_outside_the_plan_raises():
    with pytest.raises(ConfigError, match="this elastic job has WORLD_SIZE=3 but was planned for 1 to 2 processes"):
        resolve(_launched(), RunArguments(), Topology(world_size=3, rank=0, local_world_size=1))


def test_an_elastic_rank_without_auto_resume_raises(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps(_launched(auto_resume=False)))
    with pytest.raises(ConfigError, match=r"an elastic job \(impel launch --nnodes 1:2\) continues from the last "
                                          "checkpoint when a machine is lost: turn on auto_resume"):
        Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
