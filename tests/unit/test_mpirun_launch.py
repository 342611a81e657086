"""``impel launch --mpirun_hostfile`` (impel.commands.mpirun): Accelerate's mpirun command for the same flags, the
hostfile read, and one-line refusals. The real launch (MPICH, 2 ranks) is tests/cli/test_cluster_launch.py's."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from impel.commands import mpirun
from impel.commands.launch import plan_launch
from impel.commands.main import build_parser, parse
from impel.config.run_config import ConfigError
from impel.config.yaml_file import load_config_mapping


def _plan(tmp_path: Path, *flags: str):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "c.yaml").write_text("{}\n")
    return plan_launch(parse(build_parser(), ["launch", "--config_file", str(tmp_path / "c.yaml"), "--cpu", *flags,
                                              str(tmp_path / "train.py"), "--lr", "1"]))


def test_the_command_is_accelerates_for_the_same_flags(tmp_path, monkeypatch):
    """Accelerate 1.15's simple launcher, asked the same (its _get_mpirun_args finds the same MPI on PATH)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n127.0.0.1:2\n")
    flags = ["--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
             "--main_process_port", "29511", "--mpirun_hostfile",
             str(hostfile)]
    plan = _plan(tmp_path, *flags)
    found = mpirun.find_mpirun()
    ours = mpirun.command(plan.config, plan.nproc_per_node, [sys.executable, *plan.command], found, [])
    args = launch_command_parser().parse_args(["--cpu", *flags, str(tmp_path / "train.py"), "--lr", "1"])
    theirs, _ = prepare_simple_launcher_cmd_env(_validate_launch_command(args)[0])
    assert [os.path.basename(ours[0]), *ours[1:]] == theirs
    assert ours[1:7] == ["-f", str(hostfile), "-ppn", "2", "-n", "4"]  # MPICH's spelling (Open MPI: --hostfile ...)


def test_open_mpi_is_told_which_variables_to_forward():
    found = mpirun.Mpirun("/x/mpirun", "Open MPI", "--hostfile", "--npernode", "-n", "--bind-to")
    config = argparse.Namespace(mpirun_hostfile="h", num_processes=2)
    assert mpirun.command(config, 1, ["python", "t.py"], found, ["IMPEL_CONFIG", "MASTER_PORT"]) == [
        "/x/mpirun", "--hostfile", "h", "--npernode", "1", "-n", "2", "--bind-to", "socket", "-x", "IMPEL_CONFIG",
        "-x", "MASTER_PORT", "python", "t.py"]


def test_rank_0_is_the_hostfiles_first_host(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\n\nnode7 slots=2   # fast\nnode8:2\n")
    assert mpirun.hosts(str(hostfile)) == ["node7", "node8"]
    plan = _plan(tmp_path, "--num_processes", "4", "--num_machines", "2", "--mpirun_hostfile", str(hostfile))
    assert mpirun.rendezvous(plan.config, ["node7", "node8"]) == {"MASTER_ADDR": "node7", "MASTER_PORT": "29500"}
    assert mpirun.rendezvous(plan.config, ["localhost"])["MASTER_ADDR"] == "127.0.0.1"


@pytest.mark.parametrize("write, flags, error", [
    (None, [], r"mpirun_hostfile '.*missing' does not exist or is not a file; pass the hostfile"),
    ("# nothing\n", [], r"lists no host; write one machine per line"),
    ("localhost:2\n", ["--num_machines", "2", "--num_processes", "4"],
     r"num_machines=2 but the mpirun_hostfile '.*' lists 1 host\(s\) \(localhost\); list every machine"),
    ("localhost:2\n", ["--max_restarts", "2"], r"--max_restarts 2 needs torchrun's agent, and mpirun restarts nothing"),
    ("localhost:2\n", ["--tee", "3"], r"--tee set\(s\) torchrun's agent, which does not run with --mpirun_hostfile"),
])
def test_what_mpirun_cannot_do_is_refused_in_one_line(tmp_path, write, flags, error):
    hostfile = tmp_path / ("hosts" if write is not None else "missing")
    if write is not None:
        hostfile.write_text(write)
    with pytest.raises(ConfigError, match=error):
        _plan(tmp_path, "--num_processes", "2", "--mpirun_hostfile", str(hostfile), *flags)


def test_accelerates_mpirun_config_section_is_read(tmp_path):
    (tmp_path / "a.yaml").write_text("distributed_type: MULTI_CPU\nmpirun_config:\n  mpirun_hostfile: ~/hosts\n")
    assert load_config_mapping(str(tmp_path / "a.yaml"))["mpirun_hostfile"] == os.path.expanduser("~/hosts")
    (tmp_path / "b.yaml").write_text("mpirun_config:\n  mpirun_ccl: 1\n")
    with pytest.raises(ConfigError, match=r"mpirun_config=\{'mpirun_ccl': 1\} must hold only mpirun_hostfile"):
        load_config_mapping(str(tmp_path / "b.yaml"))
    (tmp_path / "c.yaml").write_text("mpirun_config: {}\n")
    assert "mpirun_hostfile" not in load_config_mapping(str(tmp_path / "c.yaml"))
