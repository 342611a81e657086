"""``impel launch --deepspeed_hostfile`` (impel.commands.deepspeed_runner): DeepSpeed's runner command against the one
Accelerate 1.15 builds for the same flags (``prepare_deepspeed_cmd_env``), the hostfile and filters read as DeepSpeed
reads them, the environment file, and one-line refusals. The real launch (DeepSpeed's runner with its MPICH launcher,
2 ranks) is tests/cli/test_deepspeed_runner_launch.py's."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from impel.commands import deepspeed_runner
from impel.commands.flags import explicit_from_flags_list
from impel.commands.launch import plan_launch
from impel.commands.main import build_parser, parse
from impel.config import environment as env
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import read_config_file
from impel.testing import free_port

PORT = str(free_port())  # Accelerate refuses a port in use on machine 0
RUNNER = [sys.executable, "-m", "deepspeed.launcher.runner"]
BASE = ["--use_deepspeed", "--zero_stage", "2", "--num_processes", "4", "--num_machines", "2", "--machine_rank", "0",
        "--main_process_ip", "10.1.2.3", "--main_process_port", PORT, "--deepspeed_hostfile", "hosts"]
CASES = {  # the flags beyond BASE; the script
    "default launcher (pdsh)": ([], ["train.py", "--lr", "1"]),
    "pdsh": (["--deepspeed_multinode_launcher", "pdsh"], ["train.py", "--lr", "1"]),
    "pdsh, inclusion filter": (["--deepspeed_inclusion_filter", "node0@node1:0,1"], ["train.py"]),
    "pdsh, exclusion filter": (["--deepspeed_exclusion_filter", "node2"], ["train.py"]),
    "pdsh, module": (["--deepspeed_multinode_launcher", "pdsh"], ["-m", "pkg.train", "--lr", "1"]),
    "slurm": (["--deepspeed_multinode_launcher", "slurm"], ["train.py", "--lr", "1"]),
    "nossh": (["--deepspeed_multinode_launcher", "nossh", "--machine_rank", "1"], ["train.py"]),
    "mpich": (["--deepspeed_multinode_launcher", "mpich"], ["train.py", "--lr", "1"]),
    "openmpi": (["--deepspeed_multinode_launcher", "openmpi"], ["train.py"]),
    "mvapich": (["--deepspeed_multinode_launcher", "mvapich"], ["train.py"]),
}


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the hostfile "hosts" is read from the working directory, as a user's would be


def _accelerates(flags: list[str], script: list[str], home: Path, monkeypatch) -> list[str]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    monkeypatch.setenv("HF_HOME", str(home))  # no user config of Accelerate's is read
    module = ["--module"] if script[0] == "-m" else []
    args = launch_command_parser().parse_args([*flags, *module, *[s for s in script if s != "-m"]])
    _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = []  # what launch_command sets without a config file
    return prepare_deepspeed_cmd_env(args)[0]


def _impels_differences(theirs: list[str]) -> list[str]:
    """Accelerate's command with impel's deliberate differences (impel.commands.deepspeed_runner's docstring)."""
    out = [*RUNNER, *theirs[1:]]
    if out[out.index("--launcher") + 1] in ("openmpi", "mpich", "mvapich") if "--launcher" in out else False:
        at = out.index("--num_gpus")
        del out[at:at + 2]  # DeepSpeed refuses --num_gpus for its MPI launchers
    if "--no_ssh" in out:
        out.insert(out.index("--no_ssh") + 1, "--no_local_rank")
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_runner_command_is_accelerates_for_the_same_flags(case, tmp_path, monkeypatch):
    flags, script = CASES[case]
    config = RunConfig.from_dict(explicit_from_flags_list([*BASE, *flags]))
    ours = deepspeed_runner.command(config, 2, script, False, ["node0", "node1"])
    assert ours == _impels_differences(_accelerates([*BASE, *flags], script, tmp_path, monkeypatch))


def test_no_python_and_the_defaults_of_the_rendezvous(tmp_path, monkeypatch):
    """``--no_python`` as Accelerate's; without ``--main_process_ip`` rank 0 is the hostfile's first host (this
    machine: 127.0.0.1, and the MPI launchers skip DeepSpeed's ssh check, which nothing here needs)."""
    flags = [f for f in BASE if f not in ("--main_process_ip", "10.1.2.3")] + ["--deepspeed_multinode_launcher",
                                                                                "mpich"]
    config = RunConfig.from_dict(explicit_from_flags_list(flags))
    assert deepspeed_runner.command(config, 2, ["run.sh"], True, ["localhost", "127.0.0.1"])[3:] == [
        "--hostfile", "hosts", "--no_local_rank", "--launcher", "mpich", "--master_addr", "127.0.0.1",
        "--master_port", PORT, "--no_ssh_check", "--no_python", "run.sh"]
    assert "--no_ssh_check" not in deepspeed_runner.command(config, 2, ["t.py"], False, ["node0", "node1"])
    pdsh = RunConfig.from_dict(explicit_from_flags_list(flags[:-1] + ["pdsh"]))
    assert "--no_ssh_check" not in deepspeed_runner.command(pdsh, 2, ["t.py"], False, ["localhost", "127.0.0.1"])
    theirs = _accelerates(BASE[:-1] + ["hosts", "--no_python"], ["run.sh"], tmp_path, monkeypatch)
    assert theirs[-2:] == ["--no_python", "run.sh"]


def _plan(tmp_path: Path, *flags: str, hosts: str = "localhost slots=2\n127.0.0.1 slots=2\n"):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "c.yaml").write_text("{}\n")
    if hosts is not None:
        (tmp_path / "hosts").write_text(hosts)
    return plan_launch(parse(build_parser(), ["launch", "--config_file", str(tmp_path / "c.yaml"), "--cpu", *flags,
                                              str(tmp_path / "train.py")]))


FLAGS = ["--use_deepspeed", "--num_processes", "4", "--num_machines", "2"]
MPICH = [*FLAGS, "--deepspeed_multinode_launcher", "mpich"]
REFUSED = [  # (flags, hostfile text, what the error says)
    (["--deepspeed_hostfile", "missing"], None, "deepspeed_hostfile 'missing' does not exist or is not a file"),
    (["--deepspeed_hostfile", "hosts"], "node0 slots=2\nnode1:2\n", r"'hosts' line 2 \('node1:2'\) is not 'host "
                                                                    "slots=N', the form DeepSpeed's runner reads"),
    (["--deepspeed_hostfile", "hosts"], "node0 slots=2\n# x\nnode0 slots=2\n", "line 3 names 'node0' a second time"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_inclusion_filter", "localhost@node9"], "!",
     "--deepspeed_inclusion_filter 'localhost@node9' names host 'node9', which the deepspeed_hostfile 'hosts' does "
     "not list \\(its hosts: localhost, 127.0.0.1\\)"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_exclusion_filter", "localhost:5"], "!",
     "slot '5' of 'localhost' is not one of its slots 0..1"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_inclusion_filter", "localhost", "--deepspeed_exclusion_filter",
      "127.0.0.1"], "!", "exclude each other"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_exclusion_filter", "127.0.0.1:1"], "!",
     "'127.0.0.1' has 1 slot\\(s\\) in the deepspeed_hostfile 'hosts' after the filter"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_exclusion_filter", "127.0.0.1"], "!",
     "num_machines=2 but the deepspeed_hostfile 'hosts' gives 1 host\\(s\\) after the filter \\(localhost\\)"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_multinode_launcher", "mpich", "--deepspeed_inclusion_filter",
      "localhost"], "!", "DeepSpeed's mpich launcher starts every host and slot of the hostfile and cannot filter"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_multinode_launcher", "mpich"], "localhost slots=4\n127.0.0.1 "
     "slots=4\n", "is 2 per machine, but 'localhost' has 4 slot\\(s\\)"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_multinode_launcher", "ssh"], "!",
     "deepspeed_multinode_launcher='ssh' is not allowed; use one of 'pdsh', 'standard', 'openmpi'"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_multinode_launcher", "standard"], "!",
     "--deepspeed_hostfile is read by DeepSpeed's runner, which deepspeed_multinode_launcher=standard does not use"),
    (["--deepspeed_multinode_launcher", "mpich", "--main_process_ip", "127.0.0.1"], "!",
     "--deepspeed_multinode_launcher mpich needs --deepspeed_hostfile"),
    (["--deepspeed_hostfile", "hosts", "--num_machines", "1"], "!", "--deepspeed_hostfile starts the machines of a "
                                                                    "multi-machine job .* but num_machines=1"),
    (["--deepspeed_hostfile", "hosts", "--max_restarts", "1"], "!", "DeepSpeed's runner restarts nothing"),
    (["--deepspeed_hostfile", "hosts", "--machine_rank", "1", "--main_process_ip", "127.0.0.1"], "!",
     "DeepSpeed's pdsh launcher starts every machine from machine 0"),
    (["--deepspeed_hostfile", "hosts", "--mpirun_hostfile", "hosts"], "!", "keep one"),
    (["--deepspeed_hostfile", "hosts", "--deepspeed_multinode_launcher", "mpich", "--tee", "3"], "!",
     "--tee set\\(s\\) torchrun's agent, which does not run with --deepspeed_hostfile"),
]


@pytest.mark.parametrize("flags,hosts,error", REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_what_deepspeeds_runner_would_stop_on_is_one_line_before_anything_starts(flags, hosts, error, tmp_path):
    hostfile = "localhost slots=2\n127.0.0.1 slots=2\n" if hosts == "!" else hosts
    with pytest.raises(ConfigError, match=error):
        _plan(tmp_path, *FLAGS, *flags, hosts=hostfile)


def test_the_hostfile_without_deepspeed_refuses_naming_both(tmp_path):
    with pytest.raises(ConfigError, match="deepspeed_hostfile='hosts' starts the ranks with DeepSpeed's runner, but "
                                          "distributed_type=None; add --use_deepspeed"):
        _plan(tmp_path, "--num_processes", "4", "--num_machines", "2", "--deepspeed_hostfile", "hosts")


@pytest.mark.skipif(shutil.which("pdsh") is not None, reason="pdsh is installed here")
def test_pdsh_not_installed_names_the_other_launchers(tmp_path):
    with pytest.raises(ConfigError, match="--deepspeed_multinode_launcher pdsh needs 'pdsh', which is not installed "
                                          r"\(not on PATH\); install it, or pick another launcher: standard, openmpi, "
                                          "mvapich, mpich, nossh, slurm"):
        _plan(tmp_path, *FLAGS, "--deepspeed_hostfile", "hosts")


def test_a_valid_plan_keeps_the_hosts_and_the_filters(tmp_path):
    plan = _plan(tmp_path, *MPICH, "--deepspeed_hostfile", "hosts")
    assert plan.config.deepspeed.deepspeed_multinode_launcher == "mpich"
    assert deepspeed_runner.check(plan.config, plan.nproc_per_node) == {"localhost": [0, 1], "127.0.0.1": [0, 1]}
    config = RunConfig.from_dict(explicit_from_flags_list([*FLAGS, "--deepspeed_hostfile", "hosts",
                                                           "--deepspeed_exclusion_filter", "localhost:0@localhost:1"]))
    with pytest.raises(ConfigError, match=r"gives 1 host\(s\) after the filter \(127.0.0.1\)"):
        deepspeed_runner.check(config, 2)


def test_the_config_keys_load_from_accelerates_yaml(tmp_path):
    """Accelerate's ``deepspeed_config`` keys of the runner are config keys (no longer refused as inert)."""
    (tmp_path / "c.yaml").write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 4\ndeepspeed_config:\n  zero_stage: 2\n"
        "  deepspeed_hostfile: /job/hostfile\n  deepspeed_multinode_launcher: openmpi\n"
        "  deepspeed_inclusion_filter: null\n  deepspeed_exclusion_filter: null\n")
    keys = read_config_file(str(tmp_path / "c.yaml"))
    assert keys["deepspeed_config"]["deepspeed_hostfile"] == "/job/hostfile"
    config = RunConfig.from_dict(keys)
    assert deepspeed_runner.launcher(config) == "openmpi" and deepspeed_runner.uses_runner(config)


def test_the_environment_file_carries_the_ranks_variables(tmp_path, monkeypatch):
    """Every variable DeepSpeed forwards verbatim, IMPEL_CONFIG base64-encoded (read back as the JSON); the user's own
    ``.deepspeed_env`` lines first; a variable impel sets that DeepSpeed would quote is refused."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\n")
    config = '{"deepspeed_config": {"zero_stage": 2}, "distributed_type": "DEEPSPEED"}'
    variables = {**env.read_variables(["PATH"]), "IMPEL_CONFIG": config, "ACCELERATE_USE_CPU": "true",
                 "RANK": "3", "PYTHONPATH": "/x"}
    lines = Path(deepspeed_runner.environment_file(str(tmp_path), variables)).read_text().splitlines()
    assert lines[0] == "NCCL_SOCKET_IFNAME=eth0" and "ACCELERATE_USE_CPU=true" in lines
    assert not any(line.startswith(("RANK=", "PYTHONPATH=")) for line in lines)  # per rank / DeepSpeed's own
    encoded = next(line.split("=", 1)[1] for line in lines if line.startswith("IMPEL_CONFIG="))
    assert env.read_launch_config({"IMPEL_CONFIG": encoded}) == {"deepspeed_config": {"zero_stage": 2},
                                                                 "distributed_type": "DEEPSPEED"}
    with pytest.raises(ConfigError, match="HF_TOKEN_PATH='a b' cannot reach the other machines through DeepSpeed's"):
        deepspeed_runner.environment_file(str(tmp_path), {**variables, "HF_TOKEN_PATH": "a b"})


def test_config_convert_keeps_the_keys_and_writes_a_launchable_fsdp_file(tmp_path):
    """``impel config convert --to fsdp`` of a runner config: the keys are named in a note (no FSDP counterpart),
    rank 0 stays on the hostfile's first host, and the written config loads; ``--to deepspeed`` keeps them."""
    from impel.config.convert import convert

    (tmp_path / "hosts").write_text("# the cluster\nnode0 slots=2\nnode1 slots=2\n")
    explicit = {"distributed_type": "DEEPSPEED", "num_machines": 2, "num_processes": 4,
                "deepspeed_config": {"zero_stage": 3, "deepspeed_hostfile": "hosts",
                                     "deepspeed_multinode_launcher": "mpich"}}
    fsdp, notes = convert(explicit, "fsdp")
    assert fsdp["main_process_ip"] == "node0" and "deepspeed_config" not in fsdp
    assert any(n.startswith("deepspeed_hostfile, deepspeed_multinode_launcher: DeepSpeed's runner") for n in notes)
    RunConfig.from_dict(fsdp)
    assert convert(explicit, "deepspeed")[0] == explicit
