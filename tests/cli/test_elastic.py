"""Elastic jobs (``impel launch --nnodes 1:2``): two loopback "machines" (two ``impel launch`` processes on
127.0.0.1, c10d rendezvous hosted by machine 0). Machine 1 is lost mid-run (its rank SIGKILLs its agent, then
itself): machine 0 continues alone from the last checkpoint with the accumulation doubled, and ends with the
parameters of the uninterrupted job (and of one process with the same global batch and order); when machine 1
comes back, the job grows back to two. No process is left running afterwards."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import SCRIPTS, Result, finish, impel, start_impel
from impel.testing import free_port
from reliability_round3_launch import LAUNCH_CASES

LIMIT = 240  # per launch: a hang fails at this limit, with the machines' output
# the inner limits of the longest test (its fixture, then four waits of LIMIT and one of 60 s) stay below this
pytestmark = [pytest.mark.slow, pytest.mark.timeout(5 * LIMIT + 120)]
SCRIPT = str(SCRIPTS / "elastic.py")
STEPS = "10"
# a machine that joins within 25 s of the first joins the first round (its launcher starts after the store is up;
# a loaded CI machine can take several seconds to import it); a lost one is dropped after 5 missed beats
RDZV = "last_call_timeout=25,keep_alive_interval=1,keep_alive_max_attempt=5"
SHRINK = ("impel: elastic restart: world size 2 -> 1, gradient accumulation 1 -> 2 (global batch 8 = 4 per process "
          "x 2 x 1 kept); resumed from ")
GROW = ("impel: elastic restart: world size 1 -> 2, gradient accumulation 2 -> 1 (global batch 8 = 4 per process "
        "x 1 x 2 kept); resumed from ")


def _machine(port: int, rank: int, home: Path, *script_args: str) -> list[str]:
    return ["launch", "--cpu", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            "--machine_rank", str(rank), "--max_restarts", "3", "--rdzv_conf", RDZV, SCRIPT, str(home / "run"), STEPS,
            *script_args]


def _report(res: Result) -> dict:
    assert res.returncode == 0, res.output[-6000:]
    reports = res.reports()
    assert len(reports) == 1, res.output[-6000:]
    return reports[0]


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _no_rank_left(home: Path) -> None:
    """Every rank any attempt started (they append their pids) is gone within a few seconds (the ranks of a
    killed agent die with it: parent-death signal)."""
    pids = [int(line) for line in (home / "pids").read_text().split()] if (home / "pids").exists() else []
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks still running: {left}"


@pytest.fixture
def launches():
    """The ``impel launch`` processes a test starts: any still running at its end (a failed assertion) is killed
    with its process group, so a failing test leaves no launcher behind either."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same job on two processes of one machine, never interrupted."""
    home = tmp_path_factory.mktemp("uninterrupted")
    return _report(impel(["launch", "--cpu", "--num_processes", "2", SCRIPT, str(home / "run"), STEPS], home,
                         timeout=LIMIT))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, accumulation 2, the DataLoader shuffling with its own generator: the global batch and the order
    of two machines with accumulation 1 (4 x 2 x 1 = 4 x 1 x 2)."""
    home = tmp_path_factory.mktemp("one_process")
    return _report(impel(["launch", SCRIPT, str(home / "run"), STEPS, "--accumulation", "2", "--seeded_loader"], home,
                         timeout=LIMIT))


def _listening(machine_0: subprocess.Popen, port: int) -> bool:
    """Machine 0's agent hosts the rendezvous on ``port``: True once it accepts connections, False when machine 0
    exited first (the port was taken)."""
    deadline = time.monotonic() + LIMIT
    while machine_0.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def _lose_machine_1(launches: list, home: Path, grow: bool, *script_args: str) -> tuple[subprocess.Popen, int]:
    """Start both machines (machine 1 dies after optimizer step 4); return machine 0's process and the port. Another
    process may take the port between free_port() and machine 0's bind (machine 0 then fails at once): retry."""
    for _ in range(3):
        port = free_port()
        extra = {"ELASTIC_GROW_AT": "6"} if grow else {}
        first = start_impel(_machine(port, 0, home, *script_args), home, **extra)
        launches.append(first)
        if not _listening(first, port):
            assert "in use" in finish(first).output  # the only way machine 0 fails before its ranks start
            continue
        launches.append(start_impel(_machine(port, 1, home, *script_args), home, ELASTIC_DIE_AT="4"))
        second = finish(launches[-1], timeout=LIMIT)
        assert second.returncode == -signal.SIGKILL, second.output[-6000:]  # its own SIGKILL, no error of impel's
        return first, port
    raise AssertionError("no free port in 3 attempts")


def test_losing_a_machine_continues_on_the_other_with_the_same_global_batch(uninterrupted, launches, tmp_path):
    """The sampler shuffles with the generator impel gives it: the survivor alone keeps that order."""
    first, _ = _lose_machine_1(launches, tmp_path, False)
    try:
        res = finish(first, timeout=LIMIT)
        survivor = _report(res)
        assert survivor["world"] == 1 and survivor["accumulation"] == 2 and survivor["steps"] == 10
        assert _largest_difference(survivor["params"], uninterrupted["params"]) < 1e-5
        assert res.output.count(SHRINK) == 1, res.output[-6000:]  # one line names the change
        assert res.output.count("elastic restart") == 1 and "has no RNG state" not in res.output
    finally:
        _no_rank_left(tmp_path)


def test_a_frozen_machine_is_declared_lost_and_the_job_continues_without_it(uninterrupted, launches, tmp_path):
    """Machine 1 is stopped (SIGSTOP on its agent and rank) after step 4: its connections stay open, so no
    collective fails and its agent cannot say it left. Machine 0's stall watchdog sees rank 1's heartbeat stop,
    says so in one line and exits its rank; the agent restarts without machine 1 and the job ends as if machine 1
    had died."""
    for _ in range(3):
        port = free_port()
        first = start_impel(_machine(port, 0, tmp_path), tmp_path,
                            IMPEL_STALL_WARNING="4")
        launches.append(first)
        if _listening(first, port):
            break
        assert "in use" in finish(first).output
    else:
        raise AssertionError("no free port in 3 attempts")
    frozen = start_impel(_machine(port, 1, tmp_path), tmp_path, ELASTIC_FREEZE_AT="4", IMPEL_STALL_WARNING="4")
    launches.append(frozen)
    try:
        res = finish(first, timeout=LIMIT)
        survivor = _report(res)
        assert survivor["world"] == 1 and survivor["accumulation"] == 2 and survivor["steps"] == 10
        assert _largest_difference(survivor["params"], uninterrupted["params"]) < 1e-5
        lost = [line for line in res.stderr.splitlines() if line.startswith("impel watchdog: rank 1 has sent no")]
        assert len(lost) == 1 and re.fullmatch(LAUNCH_CASES["frozen_machine"][1], lost[0]), res.output[-6000:]
        assert res.output.count(SHRINK) == 1, res.output[-6000:]
    finally:
        os.killpg(frozen.pid, signal.SIGKILL)  # a stopped process takes SIGKILL
        frozen.communicate()
        _no_rank_left(tmp_path)


def test_the_job_grows_back_when_the_machine_returns(one_process, launches, tmp_path):
    """With the DataLoader's own generator, the order is the same on one process too."""
    first, port = _lose_machine_1(launches, tmp_path, True, "--seeded_loader")
    try:
        deadline = time.monotonic() + LIMIT
        while not (tmp_path / "alone").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "alone").exists(), "machine 0 never ran alone"
        back = start_impel(_machine(port, 1, tmp_path, "--seeded_loader"), tmp_path)
        launches.append(back)
        grown = finish(first, timeout=LIMIT)
        returned = finish(back, timeout=60)
        report = _report(grown)
        assert returned.returncode == 0, returned.output[-6000:]
        assert report["world"] == 2 and report["accumulation"] == 1 and report["steps"] == 10
        assert _largest_difference(report["params"], one_process["params"]) < 1e-5
        assert grown.output.count(SHRINK) == 1 and grown.output.count(GROW) == 1, grown.output[-6000:]
        assert grown.output.index(SHRINK) < grown.output.index(GROW)
    finally:
        _no_rank_left(tmp_path)


def test_losing_machine_0_ends_the_job_with_one_line(launches, tmp_path):
    """Machine 0 hosts the c10d rendezvous: without it the other machine cannot go on, and says so (no hang)."""
    for _ in range(3):
        port = free_port()
        first = start_impel(_machine(port, 0, tmp_path), tmp_path, ELASTIC_DIE_AT="4")
        launches.append(first)
        if _listening(first, port):
            break
        finish(first)
    else:
        raise AssertionError("no free port in 3 attempts")
    try:
        launches.append(start_impel(_machine(port, 1, tmp_path), tmp_path))
        other = finish(launches[-1], timeout=LIMIT)
        assert finish(first).returncode == -signal.SIGKILL
        assert other.returncode == 1, other.output[-6000:]
        assert other.stderr.strip().splitlines()[-1] == (
            f"impel launch: the rendezvous at 127.0.0.1:{port} failed (RendezvousConnectionError: The connection to "
            "the C10d store has failed. See inner exception for details.); machine 0 (--machine_rank 0) hosts it, "
            "so when that machine is gone or unreachable the job cannot go on: start machine 0 again, then the "
            "others (with --auto_resume the job continues from its last checkpoint)")
    finally:
        _no_rank_left(tmp_path)
