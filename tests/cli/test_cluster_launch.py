"""A training script started by another launcher than impel's: real MPI (``mpiexec`` from the ``mpich`` package),
no ``impel launch``. The ranks find each other from MPI's variables (impel.config.cluster) and train one model."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import ROOT, SCRIPTS, clean_env, finish
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
