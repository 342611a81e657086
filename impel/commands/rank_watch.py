"""The launcher's hold on the ranks it starts: they die with it, and it knows which rank left first, and how.

- **No orphans.** torchrun's agent starts each rank in a new session (``start_new_session=True``), so a launcher
  killed with SIGKILL (which it cannot catch) left its ranks training on as orphans (issue 27). Each rank is now
  started with Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills it when the
  launcher dies, whatever killed the launcher. SIGKILL because nobody is left to report to or wait for; a
  checkpoint being written is never half-visible (they are committed by rename). Where ``prctl`` does not exist
  (macOS), nothing changes.
- **Who left first.** A rank that ends early with ``sys.exit(0)`` makes its peers fail in their next collective;
  torchrun reports only those failures ("rank 1 failed"). A thread watches every rank's exit (``waitid`` with
  ``WNOWAIT``, leaving the reaping to the agent) and keeps the order and the codes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.02


def _prctl() -> Callable[..., int] | None:
    if not hasattr(os, "waitid") or not os.path.exists("/proc/self"):  # Linux only
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def die_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies; None where it cannot."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between the fork and the prctl
            os._exit(1)

    return preexec


class RankWatch:
    """The ranks started while :meth:`installed` is active, and the order in which they exited."""

    def __init__(self) -> None:
        self.procs: list[tuple[int, subprocess.Popen[bytes]]] = []
        self.exits: list[tuple[float, int, int]] = []  # (time.time(), rank, exit code or -signal), in order
        self.exit_dir = tempfile.mkdtemp(prefix="impel-launch-")  # where ranks note a normal exit (rank_health)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.notes: list[tuple[float, int]] = []

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        """``subprocess.Popen`` for a rank: parent-death signal set, the process recorded with its RANK."""
        preexec = die_with_this_process()
        if preexec is not None and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = preexec
        proc: subprocess.Popen[bytes] = subprocess.Popen(*args, **kwargs)
        rank = int((kwargs.get("env") or {}).get("RANK", len(self.procs)))
        with self._lock:
            self.procs.append((rank, proc))
        return proc

    @contextmanager
    def installed(self) -> Iterator[RankWatch]:
        """torchrun's agent starts its ranks through :meth:`popen` while this is active."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

        original = handler.Popen
        handler.Popen = self.popen  # type: ignore[assignment, misc]
        thread = threading.Thread(target=self._watch, name="impel-rank-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            handler.Popen = original  # type: ignore[misc]
            self._stop.set()
            thread.join(1.0)
            self._poll()
            self.notes = self._normal_exits()
            shutil.rmtree(self.exit_dir, ignore_errors=True)

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            seen = {rank for _, rank, _ in self.exits}
            running = [(rank, proc) for rank, proc in self.procs if rank not in seen]
        for rank, proc in running:
            code = _exit_code(proc)
            if code is not None:
                with self._lock:
                    self.exits.append((time.time(), rank, code))

    def _normal_exits(self) -> list[tuple[float, int]]:
        """(time, rank) of each rank that noted a normal exit
        (:func:`impel.runtime.ranks.rank_health.note_normal_exit`)."""
        found = []
        for path in Path(self.exit_dir).glob("rank*"):
            try:
                found.append((float(path.read_text(encoding="utf-8")), int(path.name[len("rank"):])))
            except (OSError, ValueError):
                continue
        return found

    def first_exit(self) -> tuple[int, str, int] | None:
        """(rank, how, exit code) of the rank that left first: the first to begin a normal exit while in impel's
        process group (its script ended or called ``sys.exit``: it noted it) or to fail; None when none has. A bare
        exit with code 0 (a script without impel, or one that has left the group) is no cause for the others."""
        with self._lock:
            codes = {rank: code for _, rank, code in self.exits}
            events = [(t, rank, describe_exit(code), code) for t, rank, code in self.exits if code != 0]
        for t, rank in self.notes:
            code = codes.get(rank, 0)
            how = "its script ending (it returned or called sys.exit())" if code == 0 else \
                f"its script ending with {describe_exit(code)}" + (f" (sys.exit({code}))" if code > 0 else "")
            events.append((t, rank, how, code))
        return min(events)[1:] if events else None


def _exit_code(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit code (-signal) of a rank that has exited, without reaping it; None while it runs."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped by the agent
        return proc.returncode
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def describe_exit(code: int) -> str:
    """``exit code 1`` / ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
