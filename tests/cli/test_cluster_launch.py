"""A training script started by another launcher than impel's: real MPI (``mpiexec`` from the ``mpich`` package),
no ``impel launch``. The ranks find each other from MPI's variables (impel.config.cluster) and train one model."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import ROOT, SCRIPTS, clean_env, finish, impel
from impel.testing import free_port

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich: the dev extra has it)")
def test_mpiexec_ranks_train_one_model_as_the_single_process_reference(tmp_path):
    """``mpiexec -n 2 python train.py``: rank 0 and 1 of 2 (not two ranks 0 of 1 training alone), the same model
    on both, equal to one process over the same global batches (<= 1e-5)."""
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, str(SCRIPTS / "train_small.py"), "6"],
                            cwd=tmp_path, env=clean_env(tmp_path, MASTER_PORT=str(free_port())), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result = finish(proc, timeout=120)
    assert result.returncode == 0, result.output
    reports = result.reports()
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)], result.output
    assert reports[0]["checksum"] == reports[1]["checksum"] and reports[0]["losses"] == reports[1]["losses"]
    assert max(r["diff"] for r in reports) < 1e-5
    assert {r["distributed_type"] for r in reports} == {"MULTI_CPU"}


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich: the dev extra has it)")
def test_impel_launch_with_an_mpirun_hostfile_trains_as_the_single_process_reference(tmp_path):
    """``impel launch --mpirun_hostfile hosts`` (accelerate launch's multi-CPU route) starts the ranks with the
    installed mpirun on the hostfile's hosts: ranks 0 and 1 of 2, one model, equal to one process (<= 1e-5)."""
    from impel.commands.mpirun import find_mpirun

    found = find_mpirun()  # the one impel launch will use: its hostfile syntax
    (tmp_path / "hosts").write_text("localhost slots=2\n" if found.flavour == "Open MPI" else "localhost:2\n")
    res = impel(["launch", "--cpu", "--num_processes", "2", "--mpirun_hostfile", "hosts", "--main_process_port",
                 str(free_port()), str(SCRIPTS / "train_small.py"), "6"], tmp_path, timeout=120)
    assert res.returncode == 0, res.output
    assert f"impel launch: starting 2 rank(s) with {found.flavour}'s {Path(found.program).name} on localhost" \
        in res.stderr
    reports = sorted(res.reports(), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)], res.output
    assert reports[0]["checksum"] == reports[1]["checksum"] and max(r["diff"] for r in reports) < 1e-5


def test_ray_train_runs_the_impel_loop_on_two_workers_as_the_single_process_reference(tmp_path):
    """examples/ray_train.py: Ray Train's TorchTrainer (real Ray, 2 CPU workers) makes the process group and sets
    ACCELERATE_TORCH_DEVICE; impel adopts both: ranks 0 and 1 of 2, equal to one process (<= 1e-5)."""
    pytest.importorskip("ray.train")
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "ray_train.py")], cwd=tmp_path,
                            env=clean_env(tmp_path, RAY_USAGE_STATS_ENABLED="0"), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    result = finish(proc, timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    rows = [json.loads(line.split("REPORT ", 1)[1]) for line in result.output.splitlines() if "REPORT {" in line]
    by_rank = {row["rank"]: row for row in rows}  # Ray may echo a worker's line twice
    assert sorted(by_rank) == [0, 1] and {row["world"] for row in rows} == {2}, result.output[-4000:]
    assert max(row["diff"] for row in rows) < 1e-5 and {row["device"] for row in rows} == {"cpu"}


def _srun(rank: int, port: int) -> dict[str, str]:
    """What ``srun --ntasks 2`` sets for task ``rank`` of a one-node step (no torchrun, no impel launch)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
            "MASTER_PORT": str(port)}


def _kubeflow(rank: int, port: int) -> dict[str, str]:
    """What a Kubeflow PyTorchJob sets in the pod of replica ``rank`` (one process per pod, no LOCAL_RANK)."""
    return {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "RANK": str(rank), "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("variables", [_srun, _kubeflow], ids=["srun", "kubeflow"])
def test_a_cluster_environment_places_two_ranks_as_the_single_process_reference(variables, tmp_path):
    """The training script started twice with the variables srun or a Kubeflow PyTorchJob sets (2 local
    processes, no launcher of impel's or torch's): ranks 0 and 1 of 2 training one model, equal to one process over
    the same global batches (<= 1e-5)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "train_small.py"), "6"], cwd=tmp_path,
                              env=clean_env(tmp_path, OMP_NUM_THREADS="1", **variables(rank, port)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for rank in (0, 1)]
    results = [finish(proc, timeout=120) for proc in procs]
    assert all(r.returncode == 0 for r in results), [r.output[-3000:] for r in results]
    reports = [r.reports()[0] for r in results]
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)], [r.output for r in results]
    assert reports[0]["checksum"] == reports[1]["checksum"] and reports[0]["losses"] == reports[1]["losses"]
    assert max(r["diff"] for r in reports) < 1e-5
    assert {r["distributed_type"] for r in reports} == {"MULTI_CPU"}
