"""Crashes and preemptions cost minutes, never data: a run killed or preempted partway ends with parameters
bitwise equal to the uninterrupted run's (fp32, CPU, dropout, shuffling, accumulation, a scheduler)."""
from __future__ import annotations

import pytest

from cli_helpers import SCRIPTS, impel

LAUNCH_TIMEOUT = 240
# the module fixture's launch plus up to three per test: pytest-timeout sits above their sum, so a hang is
# reported by the launch's own limit (with the ranks' output)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * LAUNCH_TIMEOUT + 60)]
SCRIPT = str(SCRIPTS / "resumable.py")
STEPS = "8"


def _digest(res) -> str:
    assert res.returncode == 0, res.output[-5000:]
    reports = res.reports()
    assert len(reports) == 2 and reports[0]["sha"] == reports[1]["sha"], reports
    return reports[0]["sha"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    home = tmp_path_factory.mktemp("uninterrupted")
    return _digest(impel(["launch", "--cpu", "--num_processes", "2", SCRIPT, str(home / "run"), STEPS], home,
                          timeout=LAUNCH_TIMEOUT))


@pytest.mark.parametrize("kill_at", [3, 4, 7])
def test_a_killed_rank_restarts_and_resumes_exactly(kill_at, uninterrupted, tmp_path):
    """Rank 1 is SIGKILLed after step N; torchrun restarts the job, which resumes from the newest checkpoint."""
    res = impel(["launch", "--cpu", "--num_processes", "2", "--max_restarts", "2", "--auto_resume", SCRIPT,
                 str(tmp_path / "run"), STEPS, "--kill_at", str(kill_at)], tmp_path, timeout=LAUNCH_TIMEOUT)
    assert _digest(res) == uninterrupted
    assert "auto_resume: resumed from" in res.output and all(not r["first_attempt"] for r in res.reports())


def test_sigterm_saves_stops_and_a_relaunch_continues_exactly(uninterrupted, tmp_path):
    cmd = ["launch", "--cpu", "--num_processes", "2", "--auto_resume", SCRIPT, str(tmp_path / "run"), STEPS,
           "--sigterm_at", "3"]
    stopped = impel(cmd, tmp_path, timeout=LAUNCH_TIMEOUT)
    assert stopped.returncode != 0 and not stopped.reports()
    assert "impel: preempted; saved" in stopped.output and "stopped by SIGTERM" in stopped.stderr
    again = impel(cmd, tmp_path, timeout=LAUNCH_TIMEOUT)  # the same command: it resumes where the preemption saved
    assert "auto_resume: resumed from" in again.output
    assert _digest(again) == uninterrupted


def test_single_process_preemption_exits_75(tmp_path):
    cmd = ["launch", "--auto_resume", SCRIPT, str(tmp_path / "run"), STEPS, "--sigterm_at", "3"]
    stopped = impel(cmd, tmp_path, timeout=LAUNCH_TIMEOUT)
    assert stopped.returncode == 75, stopped.output[-3000:]
    assert "preempted: the ranks saved a checkpoint and stopped (exit code 75)" in stopped.stderr
    again = impel(cmd, tmp_path, timeout=LAUNCH_TIMEOUT)
    assert again.returncode == 0 and again.reports()[0]["steps"] == 8
    plain = impel(["launch", SCRIPT, str(tmp_path / "plain"), STEPS], tmp_path, timeout=LAUNCH_TIMEOUT)
    assert again.reports()[0]["sha"] == plain.reports()[0]["sha"]
