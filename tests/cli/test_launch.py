"""``impel launch`` end to end: ranks, config files, precedence, and the two-"machine" loopback run."""
from __future__ import annotations

import os
import signal
import socket

import pytest

from cli_helpers import FIXTURES, SCRIPTS, finish, impel, start_impel
from impel.testing import free_port

pytestmark = pytest.mark.slow
REPORT = str(SCRIPTS / "report.py")


def test_two_cpu_ranks_see_their_rank_and_world_size(tmp_path):
    res = impel(["launch", "--cpu", "--num_processes", "2", REPORT, "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    reports = res.reports()
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    assert {r["distributed_type"] for r in reports} == {"MULTI_CPU"}
    # only the keys that were set travel to the ranks; defaults are filled in by each rank
    assert reports[0]["launched"] == {"num_processes": 2, "use_cpu": True}
    assert reports[0]["omp"] == "1" and "OMP_NUM_THREADS" not in res.stderr


def test_parallelism_flags_reach_the_ranks_as_one_mesh_and_a_wrong_product_stops_the_launch(tmp_path):
    res = impel(["launch", "--cpu", "--num_processes", "2", "--use_parallelism_config",
                 "--parallelism_config_tp_size", "2", REPORT, "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    reports = res.reports()
    assert [(r["mesh"], r["tp_rank"]) for r in reports] == [(["tp"], 0), (["tp"], 1)]
    assert reports[0]["launched"]["parallelism_config"] == {"parallelism_config_tp_size": 2}
    marker = tmp_path / "started"
    res = impel(["launch", "--cpu", "--num_processes", "2", "--parallelism_config_tp_size", "4", REPORT,
                 "--touch", str(marker)], tmp_path)
    assert res.returncode == 2 and not marker.exists()
    assert "tp_size=4, cp_size=1, sp_size=1 multiply to 4, but num_processes=2" in res.stderr


def test_one_process_runs_the_script_directly(tmp_path):
    res = impel(["launch", "--mixed_precision", "bf16", REPORT, "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    (report,) = res.reports()
    assert (report["rank"], report["world"], report["distributed_type"]) == (0, 1, "NO")
    assert report["config"]["mixed_precision"] == "bf16"


def test_an_fsdp_file_reaches_the_ranks_as_its_settings(tmp_path):
    res = impel(["launch", "--config_file", str(FIXTURES / "accelerate_fsdp.yaml"), "--cpu", REPORT, "config"],
                tmp_path)
    assert res.returncode == 0, res.output
    reports = res.reports()
    assert len(reports) == 2
    cfg = reports[1]["config"]
    assert (cfg["distributed_type"], cfg["mixed_precision"], cfg["num_processes"]) == ("FSDP", "bf16", 2)
    fsdp = cfg["fsdp_config"]
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_a_flag_beats_the_file(tmp_path):
    res = impel(["launch", "--config_file", str(FIXTURES / "accelerate_fsdp.yaml"), "--cpu",
                 "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--mixed_precision", "no", "--num_processes", "1",
                 "--fsdp_offload_params", REPORT, "config"], tmp_path)
    assert res.returncode == 0, res.output
    (report,) = res.reports()
    cfg = report["config"]
    assert (cfg["mixed_precision"], cfg["num_processes"]) == ("no", 1)
    assert cfg["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert cfg["fsdp_config"]["fsdp_offload_params"] is True
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "BertLayer"  # untouched keys stay


def test_a_deepspeed_file_reaches_the_ranks_as_its_settings(tmp_path):
    res = impel(["launch", "--config_file", str(FIXTURES / "accelerate_deepspeed.yaml"), "--cpu",
                 "--num_processes", "1", REPORT, "config"], tmp_path)
    assert res.returncode == 0, res.output
    (report,) = res.reports()
    cfg = report["config"]
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["gradient_accumulation_steps"] == 4
    ds = cfg["deepspeed_config"]
    assert (ds["zero_stage"], ds["offload_optimizer_device"], ds["gradient_clipping"]) == (2, "cpu", 1.0)


def test_switching_strategy_by_flag_drops_the_files_section_with_a_note(tmp_path):
    res = impel(["launch", "--config_file", str(FIXTURES / "accelerate_fsdp.yaml"), "--cpu", "--use_deepspeed",
                 "--num_processes", "1", REPORT, "config"], tmp_path)
    assert res.returncode == 0, res.output
    assert "its fsdp_config is not used" in res.stderr
    (report,) = res.reports()
    assert report["config"]["distributed_type"] == "DEEPSPEED" and report["config"]["fsdp_config"] is None


def test_the_default_config_file_is_used_when_present(tmp_path):
    (tmp_path / "cache" / "impel").mkdir(parents=True)
    (tmp_path / "cache" / "impel" / "default_config.yaml").write_text("mixed_precision: bf16\nuse_cpu: true\n")
    res = impel(["launch", REPORT, "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    assert res.reports()[0]["launched"] == {"mixed_precision": "bf16", "use_cpu": True}


def test_accelerates_default_config_is_read_when_impel_has_none(tmp_path):
    """A machine set up with `accelerate config default` launches under impel with that file (named in a note)."""
    accelerate_cli = pytest.importorskip("accelerate.commands.config.default")
    theirs = tmp_path / "cache" / "huggingface" / "accelerate" / "default_config.yaml"
    accelerate_cli.write_basic_config(mixed_precision="bf16", save_location=str(theirs))
    res = impel(["launch", REPORT, "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    assert f"no impel config file: read Accelerate's {theirs}" in res.output
    launched = res.reports()[0]["launched"]
    assert launched["mixed_precision"] == "bf16" and launched["distributed_type"] == "NO"


def test_a_code_argument_wins_over_the_launch_and_names_both(tmp_path):
    """As in Accelerate: the script's Accelerator(mixed_precision='fp16') wins over --mixed_precision bf16, and one
    log line names both values."""
    script = tmp_path / "contradict.py"
    script.write_text("from impel import Accelerator\nprint('PRECISION', Accelerator(mixed_precision='fp16')"
                      ".mixed_precision)\n")
    res = impel(["launch", "--mixed_precision", "bf16", str(script)], tmp_path)
    assert res.returncode == 0, res.output
    assert "PRECISION fp16" in res.stdout
    assert "mixed_precision='fp16', which overrides the launched config's mixed_precision='bf16'" in res.stderr


def test_a_failing_rank_fails_the_launch_with_its_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    res = impel(["launch", "--cpu", "--num_processes", "2", str(script)], tmp_path)
    assert res.returncode == 3, res.output
    assert "rank 1 failed with exit code 3" in res.stderr


def test_module_mode(tmp_path):
    res = impel(["launch", "--cpu", "--num_processes", "2", "-m", "impel.commands.selftest"], tmp_path)
    assert res.returncode == 0, res.output
    assert "impel test: PASS" in res.stdout


def _port_taken(result) -> bool:
    return "EADDRINUSE" in result.output or "already in use" in result.output.lower()  # torch, or impel's check


def machines_on_a_free_port(home, machine_args, next_port=free_port, attempts: int = 3):
    """Start one ``impel launch`` per machine on a port that was free a moment ago. Another process can take it
    before machine 0's agent binds it (free_port's race): then machine 0 fails with EADDRINUSE, the other machines
    are stopped, and the launch is retried on a new port. Returns the results and the ports tried."""
    tried = []
    for attempt in range(attempts):
        tried.append(next_port())
        procs = [start_impel(args, home) for args in machine_args(tried[-1])]
        first = finish(procs[0], timeout=150)
        if _port_taken(first) and attempt + 1 < attempts:
            for proc in procs[1:]:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            continue
        return [first] + [finish(proc, timeout=60) for proc in procs[1:]], tried  # machine 0 is done: the rest too
    raise AssertionError("unreachable")


def test_two_machines_on_loopback_train_together(tmp_path):
    """Two `impel launch` invocations, one per "machine", rendezvous over 127.0.0.1 and train one model. The first
    port offered is already taken (as another process may take free_port()'s port): the launch retries."""
    def machine_args(port):
        common = ["launch", "--cpu", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", str(port), str(SCRIPTS / "train_small.py"), "6"]
        return [common[:1] + ["--machine_rank", str(r)] + common[1:] for r in (0, 1)]

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        offered = iter([busy])
        results, tried = machines_on_a_free_port(tmp_path, machine_args, lambda: next(offered, None) or free_port())
    assert tried[0] == busy and len(tried) == 2  # the taken port failed and was replaced, once
    for res in results:
        assert res.returncode == 0, res.output
    reports = [r for res in results for r in res.reports()]
    assert sorted(r["rank"] for r in reports) == [0, 1] and {r["world"] for r in reports} == {2}
    assert reports[0]["checksum"] == reports[1]["checksum"]  # both machines hold the same model
    assert reports[0]["losses"] == reports[1]["losses"]
    assert max(r["diff"] for r in reports) < 1e-5  # and it is the single-process model of the same global batch


@pytest.mark.parametrize("strategy", [[], ["--use_fsdp"], ["--use_deepspeed", "--zero_stage", "3"]])
def test_impel_test_passes_on_two_ranks(strategy, tmp_path):
    # ZeRO-3 takes ~100 s here on an idle machine (DeepSpeed's start-up on 2 ranks); two suites side by side took it
    # past a 180 s limit. The bound only stops a hang, below pytest-timeout's 300 s.
    res = impel(["test", "--cpu", "--num_processes", "2", "--gradient_accumulation_steps", "2", *strategy], tmp_path,
                timeout=280)
    assert res.returncode == 0, res.output
    assert res.stdout.count("PASS [rank 0]") == 3 and "impel test: PASS" in res.stdout


@pytest.mark.parametrize("mode", ["end_training", "implicit"])
def test_the_process_group_is_destroyed_before_the_interpreter_exits(tmp_path, mode):
    """end_training() destroys impel's group (as Accelerate does); a script that never calls it gets the same from
    impel's exit handler, so gloo never tears down inside interpreter finalisation."""
    res = impel(["launch", "--cpu", "--num_processes", "2", str(SCRIPTS / "shutdown.py"), mode], tmp_path)
    assert res.returncode == 0, res.output
    rows = res.reports()
    assert [r["group_alive"] for r in rows if "group_alive" in r] == [False, False]
    assert [r["gloo_threads"] for r in rows if "gloo_threads" in r] == [0, 0]
    if mode == "end_training":
        assert [r["after_end_training"] for r in rows if "after_end_training" in r] == [False, False]


@pytest.mark.parametrize("strategy", ["--use_fsdp", "ddp"])
@pytest.mark.parametrize("mode", ["end_training", "implicit"])
def test_gloo_worker_threads_end_before_the_interpreter_after_a_prepared_model(tmp_path, strategy, mode):
    """The cause of the rare SIGABRT at exit (impel/runtime/ranks/teardown.py): a prepared FSDP2 or DDP model keeps the
    destroyed
    group's C++ object, and so gloo's worker threads, alive into interpreter finalisation, where a worker that
    releases a finished collective's tensors needs the GIL and aborts. impel's exit handler releases those
    references: no gloo worker thread may be left when the interpreter finalises (deterministic, unlike the abort)."""
    flags = [strategy] if strategy.startswith("--") else []
    res = impel(["launch", "--cpu", "--num_processes", "2", *flags, str(SCRIPTS / "shutdown.py"), mode, "model"],
                tmp_path)
    assert res.returncode == 0, res.output
    rows = res.reports()
    assert [r["gloo_threads_while_training"] for r in rows if "gloo_threads_while_training" in r] == [2, 2]
    assert [r["gloo_threads"] for r in rows if "gloo_threads" in r] == [0, 0]


def test_debug_and_use_parallelism_config_take_effect_on_the_ranks(tmp_path):
    """--debug: the ranks run in Accelerate's debug mode (ACCELERATE_DEBUG_MODE=true, as accelerate launch sets it);
    --use_parallelism_config alone: Accelerator() builds a ParallelismConfig() (every rank data parallel)."""
    res = impel(["launch", "--cpu", "--num_processes", "2", "--debug", "--use_parallelism_config", REPORT,
                 "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    reports = res.reports()
    seen = [(r["debug_variable"], r["parallelism"], r["config"]["debug"]) for r in reports]
    assert seen == [("true", True, True)] * 2
    res = impel(["launch", "--cpu", "--num_processes", "2", REPORT, "accelerator"], tmp_path)
    assert [(r["debug_variable"], r["parallelism"]) for r in res.reports()] == [("false", False)] * 2


def test_plain_torchrun_with_accelerates_variables_configures_the_run(tmp_path):
    """No impel launch: torchrun starts the ranks and ACCELERATE_* variables set the run, as under Accelerate."""
    import subprocess
    import sys

    from cli_helpers import Result, clean_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", REPORT, "accelerator"]
    env = clean_env(tmp_path, ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_GRADIENT_ACCUMULATION_STEPS="4",
                    ACCELERATE_USE_CPU="true")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=180)
    res = Result(proc.returncode, proc.stdout, proc.stderr)
    assert res.returncode == 0, res.output
    seen = [(r["rank"], r["launched"], r["config"]["mixed_precision"], r["config"]["gradient_accumulation_steps"],
             r["config"]["use_cpu"]) for r in res.reports()]
    assert seen == [(0, None, "bf16", 4, True), (1, None, "bf16", 4, True)]
