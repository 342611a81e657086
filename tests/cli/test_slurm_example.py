"""examples/slurm: the per-node script turns SLURM's variables into `impel launch` flags; two "nodes" started the
way srun starts them (same script, SLURM_NODEID 0 and 1) rendezvous over loopback with c10d and train one model."""
from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import ROOT, SCRIPTS, clean_env, finish
from impel.testing import free_port

NODE_SCRIPT = ROOT / "examples" / "slurm" / "impel_node.sh"
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


def fake_bin(tmp_path: Path, hosts: list[str]) -> Path:
    """A PATH directory with `impel` (this interpreter's impel) and a `scontrol` that expands the node list."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("impel", f'exec {shlex.quote(sys.executable)} -m impel.commands.main "$@"'),
                       ("scontrol", 'test "$1 $2" = "show hostnames" || exit 3\nprintf "%s\\n" ' + " ".join(hosts))):
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def slurm_env(tmp_path: Path, bin_dir: Path, **values: str) -> dict[str, str]:
    env = clean_env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in [k for k in env if k.startswith(("SLURM_", "IMPEL_"))]:
        del env[key]
    env.update(values)
    return env


def node(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(NODE_SCRIPT), *args], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def test_the_node_script_builds_the_launch_command_from_slurm_variables(tmp_path):
    # a long node list: reading only its first line must not fail the script (SIGPIPE under pipefail)
    bin_dir = fake_bin(tmp_path, ["gpu01", "gpu02", "gpu03", "gpu04"] + [f"n{i:05d}" for i in range(20000)])
    env = slurm_env(tmp_path, bin_dir, SLURM_JOB_NUM_NODES="4", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu[01-04]",
                    SLURM_GPUS_ON_NODE="8", IMPEL_DRY_RUN="1", IMPEL_LAUNCH_ARGS="--mixed_precision bf16")
    res = finish(node(["--use_fsdp", "train.py", "--lr", "1e-4"], env, tmp_path), timeout=30)
    assert res.returncode == 0, res.output
    assert shlex.split(res.stdout) == [
        "impel", "launch", "--num_machines", "4", "--machine_rank", "2", "--num_processes", "32",
        "--main_process_ip", "gpu01", "--main_process_port", "29500", "--rdzv_backend", "c10d",
        "--mixed_precision", "bf16", "--use_fsdp", "train.py", "--lr", "1e-4"]


@pytest.mark.parametrize("missing, message", [
    ({"SLURM_NODEID": None}, "start this script with srun"),
    ({"SLURM_GPUS_ON_NODE": None}, "no GPUs found"),
    ({"SLURM_GPUS_ON_NODE": "0"}, "no GPUs found"),
])
def test_the_node_script_names_what_is_missing(tmp_path, missing, message):
    values = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "4",
              "IMPEL_DRY_RUN": "1"}
    values.update(missing)
    env = slurm_env(tmp_path, fake_bin(tmp_path, ["n1", "n2"]), **{k: v for k, v in values.items() if v is not None})
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"  # no nvidia-smi to fall back on
    res = finish(node(["train.py"], env, tmp_path), timeout=30)
    assert res.returncode == 2 and message in res.stderr, res.output


def test_the_sbatch_file_starts_the_node_script_with_srun_once_per_node():
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun --kill-on-bad-exit=1 examples/slurm/impel_node.sh" in text
    assert "--auto_resume" in text and "#SBATCH --signal=TERM@" in text
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_two_nodes_started_like_srun_train_together_over_c10d(tmp_path):
    bin_dir = fake_bin(tmp_path, ["127.0.0.1", "127.0.0.2"])
    for attempt in range(3):  # free_port's race: another process may take the port before node 0 binds it
        port = str(free_port())
        procs = [node([str(SCRIPTS / "train_small.py"), "6"],
                      slurm_env(tmp_path, bin_dir, SLURM_NNODES="2", SLURM_NODEID=str(rank),
                                SLURM_JOB_NODELIST="127.0.0.[1-2]", IMPEL_PROCESSES_PER_NODE="1",
                                # on loopback both "nodes" match the endpoint's host and would race to host the
                                # rendezvous store; on a cluster only the first node does: say so explicitly
                                IMPEL_LAUNCH_ARGS=f"--cpu --rdzv_conf is_host={int(rank == 0)}",
                                IMPEL_MAIN_PROCESS_PORT=port), tmp_path)
                 for rank in (0, 1)]
        results = [finish(procs[0], timeout=200)]
        taken = "already in use" in results[0].output.lower() or "EADDRINUSE" in results[0].output
        if taken and attempt < 2:
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].communicate()
            continue
        results.append(finish(procs[1], timeout=120))
        break
    for res in results:
        assert res.returncode == 0, res.output
    reports = [r for res in results for r in res.reports()]
    assert sorted(r["rank"] for r in reports) == [0, 1] and {r["world"] for r in reports} == {2}
    assert reports[0]["checksum"] == reports[1]["checksum"]  # one model across both "nodes"
    assert max(r["diff"] for r in reports) < 1e-5  # the single-process model of the same global batches
