"""Rank discovery from every common launcher's variables (impel.config.cluster), as each launcher sets them."""
from __future__ import annotations

import pytest

from impel.config import environment as env
from impel.config.schema import ConfigError

OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
         "MASTER_ADDR": "node0", "MASTER_PORT": "29600"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "0",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
LSF = {"JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_SIZE": "8", "JSM_NAMESPACE_LOCAL_RANK": "1",
       "JSM_NAMESPACE_LOCAL_SIZE": "4", "MASTER_ADDR": "batch1", "MASTER_PORT": "29500"}
# srun -N 2 --ntasks-per-node 2 python train.py: task 3 on the second node
SRUN = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
# a Kubeflow PyTorchJob pod (one process per pod): the operator sets these, no LOCAL_RANK
KUBEFLOW = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
            "KUBERNETES_SERVICE_HOST": "10.0.0.1"}


@pytest.mark.parametrize("variables, expected", [
    (OPENMPI, ("OpenMPI", 1, 2, 1, 2, "127.0.0.1", 29500)),
    (MPICH, ("MPICH / Intel MPI", 3, 4, 1, 2, "node0", 29600)),
    (MVAPICH, ("MVAPICH", 0, 2, 0, 2, "127.0.0.1", 29500)),
    (LSF, ("LSF jsrun", 5, 8, 1, 4, "batch1", 29500)),
    (SRUN, ("SLURM srun", 3, 4, 1, 2, "gpu07", 10000 + 123456 % 20000)),
    (KUBEFLOW, ("Kubeflow PyTorchJob", 2, 3, 0, 1, "job-master-0", 23456)),
])
def test_each_launcher_places_the_rank(variables, expected):
    topo = env.read_topology(variables)
    assert (topo.source, topo.rank, topo.world_size, topo.local_rank, topo.local_world_size, topo.master_addr,
            topo.master_port) == expected


def test_torchrun_started_under_mpirun_wins_and_launchers_that_disagree_raise():
    under_mpirun = {**OPENMPI, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert env.read_topology(under_mpirun).source == "torchrun"
    stale = {**OPENMPI, "RANK": "0", "WORLD_SIZE": "4"}  # RANK / WORLD_SIZE exported by hand, then mpirun
    with pytest.raises(ConfigError, match=r"disagree: torchrun says rank 0 of 4, OpenMPI says rank 1 of 2"):
        env.read_topology(stale)
    agree = {**OPENMPI, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert env.read_topology(agree).rank == 1


def test_a_job_across_machines_without_a_rendezvous_names_what_to_set():
    across = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(ConfigError, match=r"OpenMPI started rank 1 of 2 across machines but MASTER_ADDR / "
                                          r"MASTER_PORT are not set; .*mpirun -x MASTER_ADDR="):
        env.read_topology(across)


def test_a_batch_scripts_own_shell_is_not_a_rank_and_task_counts_parse():
    from impel.config import cluster

    batch_shell = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert env.read_topology(batch_shell).source == "single process"
    assert [cluster._tasks_on_node("3(x2),1", n) for n in range(4)] == [3, 3, 1, None]
    assert cluster.first_host("cpu1,gpu[03-05,9]") == "cpu1" and cluster.first_host("gpu[03-05,9]") == "gpu03"


def test_another_launchers_placement_is_exported_as_torchruns_variables():
    topo = env.read_topology(OPENMPI)
    environ = dict(OPENMPI, MASTER_PORT="")
    env.export_topology(topo, environ)
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                    "MASTER_PORT")} == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                        "MASTER_PORT": "29500"}


def test_impel_env_names_the_launcher_it_found(monkeypatch):
    from impel.commands import env as env_command

    for name, value in MPICH.items():
        monkeypatch.setenv(name, value)
    assert env_command._placement() == ("launcher: MPICH / Intel MPI, rank 3 of 4 (local 1 of 2), rendezvous "
                                        "node0:29600")


def test_accelerate_torch_device_names_the_device_as_in_accelerate(monkeypatch):
    """Ray Train sets ACCELERATE_TORCH_DEVICE on its workers; impel reads it as Accelerate does."""
    import torch

    from impel.runtime.ranks.process import pick_device

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert pick_device(0, cpu=False) == torch.device("cpu")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "tpu:0")
    with pytest.raises(ConfigError, match=r"ACCELERATE_TORCH_DEVICE='tpu:0' is not a device impel runs on"):
        pick_device(0, cpu=False)
    if not torch.cuda.is_available():
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cuda:1")
        with pytest.raises(ConfigError, match=r"ACCELERATE_TORCH_DEVICE='cuda:1' but this process sees 0 CUDA"):
            pick_device(0, cpu=False)
