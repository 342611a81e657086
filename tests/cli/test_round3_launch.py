"""Issue 36, launcher part: the command line of an elastic job parses, and a rank's own exit code reaches the
launcher's. The lines are tests/reliability_round3_launch.py's (docs/reliability.md)."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from cli_helpers import SCRIPTS, impel
from reliability_round3_launch import LAUNCH_CASES

MISBEHAVE = str(SCRIPTS / "misbehave.py")


def _assert_no_rank_left(pid_dir: Path, within: float = 10.0) -> None:
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    pids = [int(f.read_text()) for f in pid_dir.glob("rank*.pid") if f.read_text()]
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks still running {within} s after the launch ended: {left}"


@pytest.mark.slow
def test_a_rank_exit_code_is_the_launch_exit_code(tmp_path):
    _, line, limit = LAUNCH_CASES["rank_exits_with_code"]
    pids = tmp_path / "pids"
    pids.mkdir()
    res = impel(["launch", "--cpu", "--num_processes", "2", MISBEHAVE, str(pids), "exit3", "1"], tmp_path,
                timeout=limit)
    assert res.returncode == 3, res.stderr[-3000:]
    assert re.search(line, res.stderr), res.stderr[-3000:]
    _assert_no_rank_left(pids)
