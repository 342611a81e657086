"""The launcher never leaves ranks behind and names what went wrong (issue 27): SIGKILL of `impel launch`, a rank
that exits early, a rank that stalls. The cases and their lines are tests/process_cases.py's (docs/reliability.md)."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from cli_helpers import SCRIPTS, impel, start_impel
from process_cases import PROCESS_CASES

pytestmark = pytest.mark.slow
MISBEHAVE = str(SCRIPTS / "misbehave.py")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rank_pids(pid_dir: Path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("rank*.pid"))
        if len(files) == 2 and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    pytest.fail(f"the ranks did not start within {timeout} s")


def _assert_no_rank_left(pid_dir: Path, within: float = 10.0) -> None:
    pids = [int(f.read_text()) for f in pid_dir.glob("rank*.pid") if f.read_text()]
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)  # do not leave them to the rest of the suite
    assert not left, f"ranks still running {within} s after the launch ended: {left}"


def test_sigkill_of_the_launcher_leaves_no_rank_alive(tmp_path):
    _, _, limit = PROCESS_CASES["launcher_sigkill"]
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = start_impel(["launch", "--cpu", "--num_processes", "2", MISBEHAVE, str(pids), "forever"], tmp_path)
    try:
        ranks = _rank_pids(pids, limit)
        assert all(_alive(p) for p in ranks)
        proc.kill()  # SIGKILL: the launcher cannot react; the kernel must take the ranks with it
        proc.wait(10)
        _assert_no_rank_left(pids, within=5.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_rank_that_exits_early_is_named_as_the_one_that_left(tmp_path):
    _, line, limit = PROCESS_CASES["rank_exits_early"]
    pids = tmp_path / "pids"
    pids.mkdir()
    res = impel(["launch", "--cpu", "--num_processes", "2", MISBEHAVE, str(pids), "exit0", "0"], tmp_path,
                timeout=limit)
    assert res.returncode == 1, res.stderr[-3000:]
    assert re.search(line, res.stderr), res.stderr[-3000:]
    _assert_no_rank_left(pids)


def test_a_stalled_rank_is_named_by_the_watchdog_long_before_the_timeout(tmp_path):
    _, line, limit = PROCESS_CASES["rank_stalls"]
    pids = tmp_path / "pids"
    pids.mkdir()
    res = impel(["launch", "--cpu", "--num_processes", "2", "--stall_warning", "2", MISBEHAVE, str(pids), "stall",
                 "1", "12"], tmp_path, timeout=limit)
    assert res.returncode == 0, res.stderr[-3000:]  # the stall ends, the job finishes
    assert re.search(line, res.stderr), res.stderr[-3000:]
    assert "rank 0 done" in res.stdout and "rank 1 done" in res.stdout
    _assert_no_rank_left(pids)


def test_the_watchdog_is_quiet_when_nothing_stalls(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    res = impel(["launch", "--cpu", "--num_processes", "2", "--stall_warning", "2", MISBEHAVE, str(pids), "stall",
                 "1", "0"], tmp_path, timeout=150)
    assert res.returncode == 0 and "impel watchdog" not in res.stderr, res.stderr[-3000:]
