"""Checkpoints on a real S3 API (moto's server on localhost, through s3fs): save, asynchronous save, rotation,
an upload killed with SIGKILL (its prefix is skipped, never loaded nor counted), and auto-resume from the newest
committed checkpoint, bitwise equal to the uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from s3_helpers import s3_server  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3_env():
    with s3_server() as env:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}, key="testing",
                               secret="testing", skip_instance_cache=True)
        fs.mkdir("impel-test")
        yield env, fs


def child(mode, project, out, env):
    script = REPO / "tests" / "s3_helpers.py"
    environ = dict(os.environ, **env, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script), mode, project, str(out)], env=environ, cwd=out.parent,
                          capture_output=True, text=True, timeout=240)


def names(fs, prefix):
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False, refresh=True))


def test_an_upload_killed_midway_is_skipped_and_auto_resume_equals_the_uninterrupted_run(s3_env, tmp_path):
    env, fs = s3_env
    full = child("full", "s3://impel-test/full", tmp_path / "full.pt", env)
    assert full.returncode == 0, full.stderr[-3000:]
    assert names(fs, "impel-test/full/checkpoints") == ["checkpoint_1", "checkpoint_2"]  # total_limit=2

    crash = child("crash", "s3://impel-test/run", tmp_path / "crash.pt", env)
    assert crash.returncode == -signal.SIGKILL, crash.stderr[-3000:]
    root = "impel-test/run/checkpoints"
    assert names(fs, root) == ["checkpoint_0", "checkpoint_1"]
    partial = names(fs, f"{root}/checkpoint_1")
    assert "COMPLETE" not in partial and "model.safetensors" in partial and "impel_checkpoint.json" in partial

    resumed = child("resume", "s3://impel-test/run", tmp_path / "resume.pt", env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from s3://impel-test/run/checkpoints/checkpoint_0 " in resumed.stdout + resumed.stderr
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resume.pt")
    assert a["steps"] == b["steps"] == 16
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    # the resumed run's saves took fresh names (checkpoint_1 is never reused), rotation kept two committed ones
    # and left the uncommitted prefix alone
    assert names(fs, root) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert "COMPLETE" not in names(fs, f"{root}/checkpoint_1")
    assert all("COMPLETE" in names(fs, f"{root}/{n}") for n in ("checkpoint_2", "checkpoint_3"))
