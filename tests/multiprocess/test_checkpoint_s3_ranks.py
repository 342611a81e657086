"""Two ranks save asynchronously to a real S3 API (moto's server) with rotation, and a new two-rank job resumes
from the newest committed checkpoint there: bitwise equal to the uninterrupted run."""
from __future__ import annotations

import pytest

from checkpoint_helpers import assert_bitwise_equal
from impel.testing import run_on_ranks

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

from s3_helpers import ranks_resume, ranks_save, s3_server  # noqa: E402

TIMEOUT = 120
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * TIMEOUT + 60)]


def test_two_ranks_resume_from_s3_bitwise(monkeypatch):
    with s3_server() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("ranks")
        full = run_on_ranks(ranks_save, 2, args=("s3://ranks/run", 10, [4, 7]), timeout=TIMEOUT)
        root = "ranks/run/checkpoints"
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["checkpoint_1"]  # total_limit=1
        files = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/checkpoint_1"))
        assert "COMPLETE" in files and {"random_states_0.pt", "random_states_1.pt"} <= set(files)
        resumed = run_on_ranks(ranks_resume, 2, args=("s3://ranks/run", 10), timeout=TIMEOUT)
        for rank in range(2):
            assert resumed[rank]["loaded"] == "s3://ranks/run/checkpoints/checkpoint_1"
            assert_bitwise_equal(full[rank], resumed[rank])
