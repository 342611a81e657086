"""Running the ``impel`` command as a user does: a real subprocess, an isolated config location, a timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "cli" / "scripts"
FIXTURES = Path(__file__).resolve().parent / "cli" / "fixtures"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "IMPEL_CONFIG", "TORCHELASTIC_RUN_ID", "IMPEL_CONFIG_FILE")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def reports(self) -> list[dict]:
        """The JSON lines scripts print as ``REPORT {...}``, sorted by rank."""
        rows = [json.loads(line[len("REPORT "):]) for line in self.stdout.splitlines() if line.startswith("REPORT ")]
        return sorted(rows, key=lambda r: r.get("rank", 0))


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(XDG_CACHE_HOME=str(home / "cache"), HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HF_HOME=str(home / "cache" / "huggingface"))  # no user's Accelerate config either
    env.update(extra)
    return env


def start_impel(args: list[str], home: Path, cwd: Path | None = None, stdin: str | None = None,
                **extra_env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "impel.commands.main", *args]
    return subprocess.Popen(cmd, cwd=cwd or home, env=clean_env(home, **extra_env), text=True,
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180, stdin: str | None = None) -> Result:
    try:
        out, err = proc.communicate(input=stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    return Result(proc.returncode, out, err)


def impel(args: list[str], home: Path, timeout: float = 180, stdin: str | None = None, **extra_env: str) -> Result:
    """Run ``impel ARGS`` with HOME and XDG_CACHE_HOME under ``home`` (no user config is ever read)."""
    return finish(start_impel(args, home, stdin=stdin, **extra_env), timeout, stdin)
