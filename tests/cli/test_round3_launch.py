"""Issue 36, launcher part: the command line of an elastic job parses, and a rank's own exit code reaches the
launcher's. The lines are tests/reliability_round3_launch.py's (docs/reliability.md)."""
from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from cli_helpers import SCRIPTS, finish, impel, start_impel
from impel.testing import free_port
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


ELASTIC = """
import os, sys
from impel import Accelerator, ProjectConfiguration
open(sys.argv[2], "a").write(f"{os.getpid()}\\n")
acc = Accelerator(project_config=ProjectConfiguration(sys.argv[1], automatic_checkpoint_naming=True,
                                                      automatic_resume=True))
acc.end_training()
"""


def _elastic_machine(port: int, rank: int, nnodes: str, home: Path) -> list[str]:
    return ["launch", "--cpu", "--nnodes", nnodes, "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            "--machine_rank", str(rank), "--max_restarts", "1", "--gradient_accumulation_steps", "6", "--rdzv_conf",
            "last_call_timeout=20,keep_alive_interval=1,keep_alive_max_attempt=5", str(home / "el.py"),
            str(home / "run"), str(home / "pids" / "all.pid")]


def _listening(proc, port: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


@pytest.mark.slow
def test_machines_that_disagree_on_nnodes_fail_naming_both(tmp_path):
    _, line, limit = LAUNCH_CASES["machines_disagree_on_nnodes"]
    (tmp_path / "el.py").write_text(ELASTIC)
    (tmp_path / "pids").mkdir()
    procs = []
    try:
        for _ in range(3):  # another process may take the port between free_port() and machine 0's bind
            port = free_port()
            procs.append(start_impel(_elastic_machine(port, 0, "1:2", tmp_path), tmp_path))
            if _listening(procs[-1], port, limit):
                break
        procs.append(start_impel(_elastic_machine(port, 1, "1:3", tmp_path), tmp_path))
        results = [finish(p, timeout=limit) for p in procs[-2:]]
        for res in results:
            assert res.returncode == 1, res.output[-6000:]
            assert re.search(line, res.stderr), res.stderr[-6000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pids = [int(x) for x in (tmp_path / "pids" / "all.pid").read_text().split()] \
            if (tmp_path / "pids" / "all.pid").exists() else []
        for pid in pids:
            (tmp_path / "pids" / f"rank{pid}.pid").write_text(str(pid))
        _assert_no_rank_left(tmp_path / "pids")


DIFFERENT = """from datetime import timedelta
import torch
from impel import Accelerator, InitProcessGroupKwargs
acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=8))])
for step in range(3):
    acc.wait_for_everyone()
if acc.process_index == 0:
    acc.wait_for_everyone()
else:
    acc.gather(torch.ones(3))
"""


@pytest.mark.slow
def test_ranks_in_different_collectives_are_named_with_their_call_sites(tmp_path):
    _, line, limit = LAUNCH_CASES["different_collectives"]
    (tmp_path / "collectives.py").write_text(DIFFERENT)
    res = impel(["launch", "--cpu", "--num_processes", "2", "--stall_warning", "2", str(tmp_path / "collectives.py")],
                tmp_path, timeout=limit)
    assert res.returncode != 0, res.stderr[-3000:]  # the group timeout ends it
    assert re.search(line, res.stderr), res.stderr[-3000:]
    assert "network?" not in res.stderr


def test_a_machine_without_machine_0_says_so_at_once_and_ends_in_one_line(tmp_path):
    """Without machine 0 (the rendezvous host), torchrun's agent retried for about two minutes in silence and then
    printed C++ frames; the launcher now says so at once and ends after the rendezvous's join_timeout."""
    _, line, limit = LAUNCH_CASES["no_machine_0"]
    (tmp_path / "el.py").write_text("raise SystemExit('never started')\n")
    res = impel(["launch", "--cpu", "--nnodes", "1:2", "--main_process_ip", "127.0.0.1", "--main_process_port",
                 str(free_port()), "--machine_rank", "1", "--max_restarts", "1", "--rdzv_conf", "join_timeout=6",
                 str(tmp_path / "el.py")], tmp_path, timeout=limit)
    assert res.returncode == 1, res.output[-3000:]
    lines = res.stderr.strip().splitlines()
    assert re.fullmatch(line, lines[-1]), res.stderr[-3000:]
    assert "does not answer (Connection refused) after 0 s" in lines[0], res.stderr[-3000:]
    assert "frame #" not in res.output and "never started" not in res.output
