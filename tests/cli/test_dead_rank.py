"""A rank that dies never leaves the job hanging: the launch ends, non-zero, naming the failed rank."""
from __future__ import annotations

import pytest

from cli_helpers import SCRIPTS, impel

pytestmark = pytest.mark.slow


def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    # impel() fails the test if the launch is still running after 120 s: a hang cannot pass
    res = impel(["launch", "--cpu", "--num_processes", "2", str(SCRIPTS / "die.py")], tmp_path, timeout=120)
    assert res.returncode != 0
    assert "rank 1 failed with signal SIGKILL" in res.stderr, res.stderr[-3000:]
    assert res.returncode == 128 + 9
