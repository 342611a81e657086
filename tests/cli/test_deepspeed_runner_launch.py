"""``impel launch --deepspeed_hostfile`` for real: DeepSpeed's runner (``python -m deepspeed.launcher.runner``) with
its MPICH launcher (``mpirun`` from the ``mpich`` package) starts the ranks of a 2-machine hostfile whose machines are
both this one (``localhost`` and ``127.0.0.1``: one host alone would make the runner start the ranks locally,
without the launcher); with ``nossh``, impel launch runs on each "machine" (``--machine_rank 0`` and ``1``) and
DeepSpeed's runner starts that machine's rank. ZeRO-2 on 2 CPU ranks, equal to one process over the same global
batches (<= 1e-5)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cli_helpers import SCRIPTS, finish, impel, start_impel
from impel.testing import free_port

MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
pytestmark = [pytest.mark.timeout(300)]
HOSTS = "localhost slots=1\n127.0.0.1 slots=1\n"
FLAGS = ["launch", "--cpu", "--use_deepspeed", "--zero_stage", "2", "--num_processes", "2", "--num_machines", "2",
         "--deepspeed_hostfile", "hosts"]


def _check_reports(reports: list[dict], output: str) -> None:
    reports = sorted(reports, key=lambda r: r["rank"])
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)], output[-4000:]
    assert {r["distributed_type"] for r in reports} == {"DEEPSPEED"}
    assert reports[0]["checksum"] == reports[1]["checksum"] and reports[0]["losses"] == reports[1]["losses"]
    assert max(r["diff"] for r in reports) < 1e-5


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install mpich: the dev extra has it)")
def test_deepspeeds_runner_with_mpich_trains_two_ranks_as_the_single_process_reference(tmp_path):
    (tmp_path / "hosts").write_text(HOSTS)
    res = impel([*FLAGS, "--deepspeed_multinode_launcher", "mpich", "--main_process_port", str(free_port()),
                 str(SCRIPTS / "train_small.py"), "6"], tmp_path, timeout=240, DS_ACCELERATOR="cpu")
    assert res.returncode == 0, res.output[-6000:]
    assert "starting 2 rank(s) with DeepSpeed's runner (mpich launcher) on localhost, 127.0.0.1" in res.stderr
    assert "-hosts localhost,127.0.0.1" in res.output  # DeepSpeed's runner logged the mpirun command it ran
    _check_reports(res.reports(), res.output)
    assert not list(tmp_path.glob(".deepspeed_env*"))  # impel's environment file lived in a temporary directory


def test_nossh_runs_deepspeeds_runner_on_every_machine_as_the_single_process_reference(tmp_path):
    (tmp_path / "hosts").write_text(HOSTS)
    args = [*FLAGS, "--deepspeed_multinode_launcher", "nossh", "--main_process_port", str(free_port())]
    procs = [start_impel([*args, "--machine_rank", str(rank), str(SCRIPTS / "train_small.py"), "6"], tmp_path,
                         DS_ACCELERATOR="cpu") for rank in (1, 0)]
    results = [finish(proc, timeout=240) for proc in procs]
    assert all(r.returncode == 0 for r in results), [r.output[-4000:] for r in results]
    for rank, result in zip((1, 0), results):  # DeepSpeed's runner logged the local launch it made for the machine
        assert "deepspeed.launcher.launch --world_info=" in result.output and f"--node_rank={rank}" in result.output
    _check_reports([report for r in results for report in r.reports()], "".join(r.output for r in results))
