"""impel.testing.run_on_ranks itself: the caller's current environment reaches the ranks, a hang or a native crash
reports the stack."""
from __future__ import annotations

import os

import pytest

from impel.testing import RankFailed, run_on_ranks

pytestmark = pytest.mark.multiprocess


def _read_env(*names: str) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def test_environment_changes_after_the_first_job_reach_the_ranks(monkeypatch):
    """The forkserver is started by the first job and keeps that moment's environment; every job must still see
    the caller's environment of its own call (monkeypatch.setenv / delenv in a test)."""
    monkeypatch.setenv("IMPEL_TEST_GONE", "before")
    monkeypatch.delenv("IMPEL_TEST_MARKER", raising=False)
    first = run_on_ranks(_read_env, 2, args=("IMPEL_TEST_MARKER", "IMPEL_TEST_GONE"))  # the server runs by now
    assert first == [{"IMPEL_TEST_MARKER": None, "IMPEL_TEST_GONE": "before"}] * 2
    monkeypatch.setenv("IMPEL_TEST_MARKER", "after")
    monkeypatch.delenv("IMPEL_TEST_GONE")
    later = run_on_ranks(_read_env, 2, args=("IMPEL_TEST_MARKER", "IMPEL_TEST_GONE", "RANK"),
                         env={"IMPEL_TEST_EXTRA": "x"})
    assert later == [{"IMPEL_TEST_MARKER": "after", "IMPEL_TEST_GONE": None, "RANK": str(r)} for r in range(2)]
    assert run_on_ranks(_read_env, 1, args=("IMPEL_TEST_EXTRA",), env={"IMPEL_TEST_EXTRA": "x"}) == [
        {"IMPEL_TEST_EXTRA": "x"}]


def _rank_one_hangs_in_a_named_function() -> str:
    import time

    if os.environ["RANK"] == "1":
        _waiting_forever_here(time)
    return "done"


def _waiting_forever_here(time_module) -> None:
    time_module.sleep(600)


def test_a_hung_rank_comes_back_with_its_python_stack():
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_rank_one_hangs_in_a_named_function, 2, timeout=10)
    message = str(err.value)
    assert "1 of 2 ranks failed" in message and "rank 1 timed out after 10s; its Python stack:" in message
    assert "_waiting_forever_here" in message  # the frame the rank hangs in, from faulthandler


def _crashes_in_a_named_function() -> None:
    _segfaulting_here()


def _segfaulting_here() -> None:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV


def test_a_rank_that_crashes_natively_comes_back_with_its_python_stack():
    """A SIGSEGV in a rank (issue 38 once saw one under load) names the Python frames it happened in."""
    with pytest.raises(RankFailed) as err:
        run_on_ranks(_crashes_in_a_named_function, 1, timeout=60)
    message = str(err.value)
    assert "rank 0 exited with code -11 without a result; its Python stack when it crashed:" in message
    assert "Segmentation fault" in message and "_segfaulting_here" in message


def _rank_zero_finishes_first(pid_dir: str) -> bool:
    """Rank 0 returns at once; rank 1, still working 1.5 s later, finds rank 0's process alive (it has not exited
    under a peer that may still be in a handshake or a collective with it)."""
    import time
    from pathlib import Path

    rank = int(os.environ["RANK"])
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 0:
        return True
    time.sleep(1.5)
    pid0 = int(Path(pid_dir, "rank0").read_text())
    try:
        os.kill(pid0, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid0}/status").read_text().find("State:\tZ") < 0  # a zombie has exited


def test_a_rank_that_finishes_first_waits_for_its_peers_before_it_exits(tmp_path):
    """The flaky "connectFullMesh failed ... Connection closed by peer" of issue 27: a rank that had finished left
    while its peer was still connecting. Every rank now leaves only when all have finished."""
    assert run_on_ranks(_rank_zero_finishes_first, 2, args=(str(tmp_path),), timeout=60) == [True, True]
